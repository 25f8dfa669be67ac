//! Start-up consistency: before the first iteration, every rank checks that it was launched like
//! rank 0.
//!
//! Ranks started with different settings (an MPMD launch, a `--set` on one rank, another build on
//! one node) would otherwise train without a word into a model that none of them describes. So
//! every rank digests what must be the same everywhere — the resolved recipe (section by section;
//! of `[runtime]` only what is not the host's own: the kernel tier and thread count may differ),
//! the executable, the training and test data as loaded, and the world size — and one
//! all-gather compares them. Every rank sees every digest, so all reach the same verdict: a
//! mismatch is [`Error::Mismatch`] on every rank, naming the first differing rank and item (for a
//! recipe section, the differing keys and both values), and no rank is left waiting.

use crate::data::dataset::{Dataset, Splits};
use crate::dist::comm::{broadcast_bytes, Communicator};
use crate::error::{Error, Result};
use crate::train::recipe::Recipe;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// The recipe's sections, compared one by one.
const SECTIONS: [&str; 6] = ["data", "model", "train", "optimizer", "balance", "runtime"];
/// `[runtime]` keys that depend on the host and may differ between ranks.
const HOST_KEYS: [&str; 2] = ["isa", "threads"];

/// The items compared, in order: the recipe's sections, then these.
const EXECUTABLE: &str = "executable (lbbsp binary)";
const TRAIN_DATA: &str = "training data as loaded";
const TEST_DATA: &str = "test data as loaded";
const WORLD: &str = "world size";

/// What every rank digests, by item name. Digests are 48 bits, exact as f64 in the all-gather.
fn fingerprint(comm: &dyn Communicator, recipe: &Recipe, data: &Splits) -> Vec<(String, u64)> {
    let flat = flat_recipe(recipe);
    let mut items: Vec<(String, u64)> = SECTIONS
        .iter()
        .map(|s| {
            let keys: Vec<String> =
                flat.iter().filter(|(k, _)| section_of(k) == *s).map(|(k, v)| format!("{k}={v}")).collect();
            (format!("recipe [{s}]"), digest48(keys.join("\n").as_bytes()))
        })
        .collect();
    items.push((EXECUTABLE.to_string(), executable_digest()));
    items.push((TRAIN_DATA.to_string(), data_digest(&data.train)));
    items.push((TEST_DATA.to_string(), data_digest(&data.test)));
    items.push((WORLD.to_string(), comm.world_size() as u64));
    items
}

fn section_of(key: &str) -> &str {
    key.split('.').next().unwrap_or(key)
}

/// The resolved recipe as `dotted.key → value`, without the host's own `[runtime]` keys.
fn flat_recipe(recipe: &Recipe) -> BTreeMap<String, String> {
    fn walk(prefix: &str, v: &toml::Value, out: &mut BTreeMap<String, String>) {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    walk(&key, v, out);
                }
            }
            other => {
                out.insert(prefix.to_string(), other.to_string());
            }
        }
    }
    let value: toml::Value = toml::from_str(&recipe.to_toml()).expect("a serialised recipe parses");
    let mut out = BTreeMap::new();
    walk("", &value, &mut out);
    out.retain(|k, _| !HOST_KEYS.iter().any(|h| *k == format!("runtime.{h}")));
    out
}

fn digest48(bytes: &[u8]) -> u64 {
    top48(Sha256::new_with_prefix(bytes))
}

/// The first 48 bits of a hash's digest, exact as an f64.
fn top48(h: Sha256) -> u64 {
    u64::from_le_bytes(h.finalize()[..8].try_into().expect("8 bytes")) & ((1 << 48) - 1)
}

/// A digest of the running executable: its length and 4 KiB of every MiB of it (reading all of a
/// debug build would take seconds; two builds differ in length or in nearly every page). Taken once
/// per process; 0 where it cannot be read.
fn executable_digest() -> u64 {
    static DIGEST: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *DIGEST.get_or_init(|| {
        use std::os::unix::fs::FileExt;
        let Ok(f) = std::env::current_exe().and_then(std::fs::File::open) else {
            return 0;
        };
        let len = f.metadata().map_or(0, |m| m.len());
        let mut h = Sha256::new();
        h.update(len.to_le_bytes());
        let mut page = vec![0u8; 4096];
        for at in (0..len).step_by(1 << 20).chain([len.saturating_sub(4096)]) {
            let n = f.read_at(&mut page, at).unwrap_or(0);
            h.update(&page[..n]);
        }
        top48(h)
    })
}

/// A digest of a loaded split: its shape, every label and a stride of its features (every value
/// would take seconds on MNIST; the files were checked against the manifest's sha256 already, so
/// this catches other files, splits or normalisation, not flipped bits).
fn data_digest(d: &Dataset) -> u64 {
    let mut h = Sha256::new();
    for n in [d.len(), d.classes].into_iter().chain(d.sample_shape.iter().copied()) {
        h.update((n as u64).to_le_bytes());
    }
    for y in &d.y {
        h.update(y.to_le_bytes());
    }
    for x in d.x.iter().step_by(997) {
        h.update(x.to_bits().to_le_bytes());
    }
    top48(h)
}

/// Checks that every rank runs the same recipe, executable, data and world as rank 0 (a
/// collective: every rank calls it before training). See the module's doc.
pub fn check(comm: &dyn Communicator, recipe: &Recipe, data: &Splits) -> Result<()> {
    let items = fingerprint(comm, recipe, data);
    let mine: Vec<f64> = items.iter().map(|(_, d)| *d as f64).collect();
    let mut all = vec![0.0; mine.len() * comm.world_size()];
    comm.all_gather_into(&mine, &mut all);
    let n = mine.len();
    let first = (1..comm.world_size()).find_map(|r| (0..n).find(|&i| all[r * n + i] != all[i]).map(|i| (r, i)));
    let Some((rank, item)) = first else {
        return Ok(());
    };
    let name = &items[item].0;
    let detail = match SECTIONS.get(item) {
        // A recipe section: rank 0's recipe and that rank's go to every rank, which compares keys.
        Some(section) => {
            let toml = recipe.to_toml().into_bytes();
            let rank0 = broadcast_bytes(comm, 0, toml.clone());
            let theirs = broadcast_bytes(comm, rank, toml);
            let parse = |b: &[u8], r: usize| {
                let text = String::from_utf8_lossy(b);
                Recipe::parse(&text, std::path::Path::new(&format!("rank {r}'s recipe")), &[]).map(|x| flat_recipe(&x))
            };
            match (parse(&rank0, 0), parse(&theirs, rank)) {
                (Ok(a), Ok(b)) => recipe_diff(section, &a, &b, rank),
                _ => String::new(),
            }
        }
        None => String::new(),
    };
    let fix = match name.as_str() {
        EXECUTABLE => "launch the same lbbsp build on every rank",
        TRAIN_DATA | TEST_DATA => "point every rank at the same data (--data-dir / LBBSP_DATA)",
        _ => "launch every rank with the same recipe and --set flags",
    };
    Err(Error::Mismatch(format!("rank {rank} differs from rank 0 in its {name}{detail}; {fix}")))
}

/// `": key = x on rank r, y on rank 0, …"` for the keys of `section` that differ between rank 0's
/// recipe and rank `rank`'s.
fn recipe_diff(
    section: &str,
    on_rank0: &BTreeMap<String, String>,
    on_rank: &BTreeMap<String, String>,
    rank: usize,
) -> String {
    let keys: std::collections::BTreeSet<&String> =
        on_rank0.keys().chain(on_rank.keys()).filter(|k| section_of(k) == section).collect();
    let unset = "unset".to_string();
    let diffs: Vec<String> = keys
        .into_iter()
        .filter(|k| on_rank0.get(*k) != on_rank.get(*k))
        .map(|k| {
            let (a, b) = (on_rank.get(k).unwrap_or(&unset), on_rank0.get(k).unwrap_or(&unset));
            format!("{k} = {a} on rank {rank}, {b} on rank 0")
        })
        .collect();
    if diffs.is_empty() {
        String::new()
    } else {
        format!(": {}", diffs.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::load::random_mnist;
    use crate::dist::comm::Local;
    use std::path::Path;

    fn recipe(overrides: &[&str]) -> Recipe {
        let text = include_str!("../../models/digits-mlp.toml");
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        Recipe::parse(text, Path::new("digits-mlp.toml"), &o).unwrap()
    }

    /// Runs `check` on `overrides.len()` local ranks, rank r with `overrides[r]`.
    fn verdicts(overrides: Vec<Vec<&'static str>>) -> Vec<Result<()>> {
        let data = std::sync::Arc::new(random_mnist());
        let n = overrides.len();
        let handles: Vec<_> = Local::group(n)
            .into_iter()
            .zip(overrides)
            .map(|(c, o)| {
                let data = data.clone();
                std::thread::spawn(move || check(&c, &recipe(&o), &data))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn alike_ranks_pass_and_host_keys_may_differ() {
        let v = verdicts(vec![vec!["runtime.threads=1"], vec!["runtime.threads=2", "runtime.isa=portable"]]);
        assert!(v.iter().all(|r| r.is_ok()), "{v:?}");
    }

    #[test]
    fn a_different_setting_on_one_rank_stops_every_rank_and_is_named() {
        let v = verdicts(vec![vec![], vec![], vec!["optimizer.lr=0.5"]]);
        let texts: Vec<String> = v.into_iter().map(|r| r.unwrap_err().to_string()).collect();
        assert!(
            texts[0].contains("rank 2 differs from rank 0 in its recipe [optimizer]: optimizer.lr = 0.5 on rank 2"),
            "{}",
            texts[0]
        );
        // Every rank stops with the same verdict, the rank in between too.
        assert!(texts.iter().all(|t| *t == texts[0]), "{texts:#?}");
    }

    #[test]
    fn a_different_global_batch_is_named() {
        let v = verdicts(vec![vec![], vec!["train.global_batch=128"]]);
        let e = v[0].as_ref().unwrap_err().to_string();
        assert!(e.contains("train.global_batch = 128 on rank 1, 64 on rank 0"), "{e}");
    }
}
