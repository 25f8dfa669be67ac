//! Recipes: one TOML file names the data set, model, optimizer, global batch, epochs, seed,
//! evaluation cadence, balancing policy and the runtime (kernel tier, threads, allreduce).
//! `--set KEY=VALUE` overrides any field; unknown or misspelled keys are errors that name the key.

use crate::balance::BalanceConfig;
use crate::data::dataset::DataConfig;
use crate::dist::comm::AllreduceChoice;
use crate::error::{Error, Result};
use crate::kernels::isa::IsaChoice;
use crate::nn::model::ModelSpec;
use crate::train::optim::OptimizerConfig;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub data: DataConfig,
    pub model: ModelSpec,
    pub optimizer: OptimizerConfig,
    pub train: TrainConfig,
    #[serde(default)]
    pub balance: BalanceConfig,
    #[serde(default)]
    pub runtime: RuntimeConfig,
}

/// The `[runtime]` section: how a rank computes and communicates. It does not change what is
/// computed (tiers agree to float rounding), but it changes every timing, so the resolved recipe
/// written next to a result holds the values the run used (`auto` resolved).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// The kernels' instruction-set tier: `auto` (the best this CPU has), `avx512`, `avx2` or
    /// `portable`. `--isa` / `LBBSP_ISA` override it.
    pub isa: IsaChoice,
    /// Rayon threads per rank; unset: `SLURM_CPUS_PER_TASK` under Slurm, else the node's cores ÷
    /// the ranks on the node. `--threads` overrides it.
    pub threads: Option<usize>,
    /// How ranks sum the gradient: `auto`, `shm`, `ring` or `mpi`. `--allreduce` /
    /// `LBBSP_ALLREDUCE` override it.
    pub allreduce: AllreduceChoice,
    /// Test aid: ranks whose compute time is stretched (`["1:3.0@30"]`: rank 1, 3× from
    /// iteration 30), to make a deterministic straggler. `--slowdown` adds to it.
    pub slowdown: Vec<crate::train::aids::Slowdown>,
    /// Seconds a rank may wait inside one collective before its watchdog ends the job, naming the
    /// ranks that did not arrive and what each was last doing (`crate::dist::watchdog`); 0: never.
    pub collective_timeout_s: f64,
    /// Signals that stop the run after the iteration it is in, with a checkpoint, and exit with
    /// status 75 (`crate::train::stop`): `TERM`, `INT`, `USR1`, `USR2` or `HUP`. Slurm's usual
    /// ones by default (SIGTERM, SIGUSR1, SIGINT); `[]` leaves every signal's default action.
    pub stop_signals: Vec<crate::train::stop::StopSignal>,
}

impl Default for RuntimeConfig {
    fn default() -> RuntimeConfig {
        RuntimeConfig {
            isa: IsaChoice::default(),
            threads: None,
            allreduce: AllreduceChoice::default(),
            slowdown: Vec::new(),
            // Long enough for a slow rank's evaluation or rank 0's checkpoint write, short enough
            // that a hung job is noticed within minutes.
            collective_timeout_s: 300.0,
            stop_signals: crate::train::stop::StopSignal::defaults(),
        }
    }
}

/// The `[train]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Global batch size B = Σ_i b_i, fixed for the whole run whatever the split.
    pub global_batch: usize,
    pub epochs: usize,
    /// Seeds initialisation and the per-epoch permutations.
    pub seed: u64,
    /// Evaluate on the test split every this many epochs (and always after the last).
    #[serde(default = "one")]
    pub eval_every_epochs: usize,
    /// Stop after this many iterations (for short experiments); the schedule still spans all epochs.
    #[serde(default)]
    pub max_iters: Option<usize>,
}

fn one() -> usize {
    1
}

impl Recipe {
    /// Reads `path`, applies `overrides` (`dotted.key=value`, value in TOML syntax or a bare string)
    /// and validates the result.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Recipe> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::parse(&text, path, overrides)
    }

    /// Like [`Recipe::load`] from text already read; `path` only names the source in errors.
    pub fn parse(text: &str, path: &Path, overrides: &[String]) -> Result<Recipe> {
        let err = |msg: String| Error::Recipe { path: PathBuf::from(path), msg };
        let recipe: Recipe = if overrides.is_empty() {
            toml::from_str(text).map_err(|e| err(e.to_string()))?
        } else {
            let mut table: toml::Table = toml::from_str(text).map_err(|e| err(e.to_string()))?;
            for o in overrides {
                set_dotted(&mut table, o).map_err(|m| err(format!("--set {o}: {m}")))?;
            }
            let merged = toml::to_string(&table).map_err(|e| err(e.to_string()))?;
            toml::from_str(&merged).map_err(|e| err(format!("after --set {}: {e}", overrides.join(" "))))?
        };
        recipe.validate()?;
        Ok(recipe)
    }

    /// Checks values that deserialise but are impossible, naming the field.
    pub fn validate(&self) -> Result<()> {
        if self.train.global_batch == 0 {
            return Err(Error::config("train.global_batch", "must be at least 1"));
        }
        if self.train.epochs == 0 {
            return Err(Error::config("train.epochs", "must be at least 1"));
        }
        if self.train.eval_every_epochs == 0 {
            return Err(Error::config("train.eval_every_epochs", "must be at least 1"));
        }
        if self.data.scale <= 0.0 || !self.data.scale.is_finite() {
            return Err(Error::config("data.scale", "must be a positive number"));
        }
        if let Some(f) = self.data.test_fraction {
            if !(f > 0.0 && f < 1.0) {
                return Err(Error::config("data.test_fraction", format!("must be in (0, 1), got {f}")));
            }
        }
        crate::dist::watchdog::check_timeout(self.runtime.collective_timeout_s)?;
        if self.runtime.threads == Some(0) {
            return Err(Error::config("runtime.threads", "must be at least 1 (leave it unset for one per core)"));
        }
        self.optimizer.validate()?;
        self.balance.validate()
    }

    /// The recipe as TOML, written next to every result.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a recipe always serialises")
    }
}

/// `(name, text)` of the TOML files `folder/NAME.toml` of the repository, embedded in the binary so
/// that shipped names work from any folder.
macro_rules! shipped {
    ($folder:literal: $($name:literal),* $(,)?) => {
        &[$(($name, include_str!(concat!("../../", $folder, "/", $name, ".toml")))),*]
    };
}
pub(crate) use shipped;

/// What a name on the command line means: an existing file, else the shipped text of that name.
pub(crate) enum Source<'a> {
    File(&'a Path),
    Shipped { path: PathBuf, text: &'static str },
    Unknown,
}

impl<'a> Source<'a> {
    pub(crate) fn of(name_or_path: &'a str, folder: &str, shipped: &[(&'static str, &'static str)]) -> Source<'a> {
        let path = Path::new(name_or_path);
        if path.exists() {
            return Source::File(path);
        }
        match shipped.iter().find(|(n, _)| *n == name_or_path) {
            Some((n, text)) => Source::Shipped { path: PathBuf::from(format!("{folder}/{n}.toml")), text },
            None => Source::Unknown,
        }
    }
}

/// The recipes shipped in `models/`.
pub const SHIPPED: &[(&str, &str)] = shipped!("models": "digits-mlp", "mnist-mlp", "a9a-logreg", "mnist-lenet5",
    "fashion-lenet5", "fashion-resnet", "bench-w1", "bench-w2");

/// Loads a recipe given as a file path, or as the name of a shipped recipe (`models/NAME.toml`).
pub fn resolve(name_or_path: &str, overrides: &[String]) -> Result<Recipe> {
    match Source::of(name_or_path, "models", SHIPPED) {
        Source::File(path) => Recipe::load(path, overrides),
        Source::Shipped { path, text } => Recipe::parse(text, &path, overrides),
        Source::Unknown => Err(Error::Recipe {
            path: PathBuf::from(name_or_path),
            msg: format!(
                "no such file, and not a shipped recipe name (known: {})",
                SHIPPED.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            ),
        }),
    }
}

/// The default `[balance]` section with `balance.KEY=VALUE` overrides applied (how `lbbsp simulate
/// --set` tries a setting on the suite).
pub fn balance_with(overrides: &[String]) -> Result<crate::balance::BalanceConfig> {
    let mut table = toml::Table::new();
    table.insert("balance".into(), toml::Value::Table(toml::Table::new()));
    for o in overrides {
        if !o.trim_start().starts_with("balance.") {
            return Err(Error::config("--set", format!("{o}: only balance.* settings act on the simulator")));
        }
        set_dotted(&mut table, o).map_err(|m| Error::config("--set", format!("{o}: {m}")))?;
    }
    let section = table.remove("balance").expect("inserted above");
    section.try_into().map_err(|e: toml::de::Error| Error::config("balance", format!("after --set: {e}")))
}

/// Sets `a.b.c = value` in a TOML table, creating intermediate tables.
fn set_dotted(table: &mut toml::Table, assignment: &str) -> std::result::Result<(), String> {
    let (key, raw) = assignment.split_once('=').ok_or("expected KEY=VALUE")?;
    let parts: Vec<&str> = key.trim().split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(format!("malformed key `{key}`"));
    }
    let value = match toml::from_str::<toml::Table>(&format!("v = {}", raw.trim())) {
        Ok(mut t) => t.remove("v").expect("parsed key"),
        Err(_) => toml::Value::String(raw.trim().to_string()),
    };
    let mut cur = table;
    for p in &parts[..parts.len() - 1] {
        let entry = cur.entry(p.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = entry.as_table_mut().ok_or_else(|| format!("`{p}` is not a table"))?;
    }
    cur.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIGITS: &str = include_str!("../../models/digits-mlp.toml");

    #[test]
    fn shipped_recipes_parse() {
        for (name, _) in SHIPPED {
            let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models").join(format!("{name}.toml"));
            let r = Recipe::load(&p, &[]).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(r.name, *name);
        }
        let files = std::fs::read_dir(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models")).unwrap().count();
        assert_eq!(files, SHIPPED.len(), "every recipe in models/ is shipped");
    }

    /// The model of every shipped recipe builds on its data set's sample shape (no data needed).
    #[test]
    fn shipped_models_build() {
        for (name, text) in SHIPPED {
            let r = Recipe::parse(text, Path::new(name), &[]).unwrap();
            let (shape, classes) = if r.data.dataset == crate::data::load::RANDOM_MNIST {
                (crate::data::load::RANDOM_MNIST_SHAPE.to_vec(), crate::data::load::RANDOM_MNIST_CLASSES)
            } else {
                let data = crate::data::manifest::spec(&r.data.dataset).unwrap();
                (data.sample_shape.clone(), data.classes)
            };
            crate::nn::model::Model::new(&r.model, &shape, classes, 1).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    /// The benchmark recipes are the peers' W1 and W2 exactly: plain SGD at a constant rate, the
    /// batch sizes, and PyTorch's parameter counts of the two models (LeNet-5 without padding).
    #[test]
    fn bench_recipes_match_the_peer_workloads() {
        use crate::train::optim::{OptimizerKind, Schedule};
        for (name, batch, params) in [("bench-w1", 128, 535_818), ("bench-w2", 64, 44_426)] {
            let r = resolve(name, &[]).unwrap();
            let o = &r.optimizer;
            assert_eq!(
                (o.kind, o.lr, o.momentum, o.nesterov, o.weight_decay),
                (OptimizerKind::Sgd, 0.05, 0.9, false, 0.0)
            );
            assert_eq!((o.schedule, o.warmup_iters, o.clip_grad_norm), (Schedule::Constant, 0, None));
            assert_eq!((r.data.dataset.as_str(), r.data.scale, r.train.global_batch), ("random-mnist", 1.0, batch));
            assert_eq!(r.data.standardize, crate::data::dataset::Standardize::None);
            let shape = crate::data::load::RANDOM_MNIST_SHAPE;
            let m = crate::nn::model::Model::new(&r.model, &shape, 10, 1).unwrap();
            assert_eq!(m.params.len(), params, "{name}");
        }
    }

    /// `[runtime]` round-trips through the resolved recipe, and a bad value names the key and the
    /// values it takes.
    #[test]
    fn runtime_settings_parse_round_trip_and_bad_ones_are_named() {
        let sets =
            ["runtime.isa=avx2", "runtime.threads=3", "runtime.allreduce=ring", "runtime.slowdown=[\"1:2.5@7\"]"];
        let r = Recipe::parse(DIGITS, Path::new("x.toml"), &sets.map(String::from)).unwrap();
        let rt = &r.runtime;
        assert_eq!(
            (rt.isa, rt.threads, rt.allreduce),
            (IsaChoice::Exactly(crate::Isa::Avx2), Some(3), AllreduceChoice::Ring)
        );
        assert_eq!(rt.slowdown, [crate::train::Slowdown { rank: 1, factor: 2.5, from_iter: 7, every: 1 }]);
        assert_eq!(Recipe::parse(&r.to_toml(), Path::new("resolved.toml"), &[]).unwrap(), r);
        assert_eq!(Recipe::parse(DIGITS, Path::new("x.toml"), &[]).unwrap().runtime, RuntimeConfig::default());
        for (set, want) in [
            ("runtime.isa=avx3", "avx512, avx2 or portable"),
            ("runtime.allreduce=tree", "runtime.allreduce"),
            ("runtime.slowdown=[\"1-3\"]", "RANK:FACTOR"),
            ("runtime.threads=0", "runtime.threads"),
            ("runtime.collective_timeout_s=-1", "runtime.collective_timeout_s"),
            ("runtime.cores=2", "cores"),
            ("runtime.stop_signals=[\"KILL\"]", "TERM, INT, USR1, USR2 or HUP"),
        ] {
            let e = Recipe::parse(DIGITS, Path::new("x.toml"), &[set.into()]).unwrap_err().to_string();
            assert!(e.contains(want), "{set}: {e}");
        }
    }

    #[test]
    fn unknown_key_is_named() {
        let text = DIGITS.replace("epochs =", "epochz =");
        let e = Recipe::parse(&text, Path::new("x.toml"), &[]).unwrap_err().to_string();
        assert!(e.contains("epochz") && e.contains("x.toml"), "{e}");
        let e = Recipe::parse(DIGITS, Path::new("x.toml"), &["train.epochz=3".into()]).unwrap_err().to_string();
        assert!(e.contains("epochz"), "{e}");
    }

    #[test]
    fn overrides_apply() {
        let r = Recipe::parse(DIGITS, Path::new("x.toml"), &["train.epochs=7".into(), "balance.policy=lbbsp".into()])
            .unwrap();
        assert_eq!(r.train.epochs, 7);
        assert_eq!(r.balance.policy, crate::balance::PolicyKind::Lbbsp);
    }
}
