//! Checkpoints: weights as safetensors, optimizer buffers as safetensors, everything else as JSON.
//!
//! One checkpoint is one folder `DIR/step-<iter>/` (`iter` = iterations completed) holding
//!
//! - `model.safetensors`: the parameters, one F32 tensor per [`ParamTable`] entry, same name and
//!   shape (`layers.1.weight [512, 784]`), loadable by any safetensors reader;
//! - `optimizer.safetensors`: the optimizer's buffers, tensor `<buffer>.<parameter>` (e.g.
//!   `exp_avg.layers.1.weight`), shaped like the parameter;
//! - `state.json` ([`TrainingState`]): position (step, epoch, batch within the epoch), optimizer
//!   step count, [`Balancer`], seed, world size, the resolved recipe as TOML, the size and sha256
//!   of both tensor files, the lbbsp version that wrote it, and its own sha256 (of the state as
//!   written with an empty `checksum`).
//!
//! The training loop is deterministic given the parameters, the optimizer state, the position in the
//! epoch permutation and the balancer state: every random stream is keyed by the seed, the epoch and
//! the sample (see [`crate::data::rng`]), so no generator state needs saving.
//!
//! Writes are atomic: the files go into a hidden temporary folder beside the final one, each is
//! fsynced, the folder is fsynced and renamed to `step-<iter>` last, then `DIR` is fsynced. A crash
//! leaves either no `step-<iter>` or a complete one; damage after the fact (truncation, flipped bits)
//! is caught by the sizes and digests in `state.json`, and [`load_latest`] then falls back to the
//! previous checkpoint.

use crate::balance::Balancer;
use crate::dist::comm::{broadcast_bytes, Communicator};
use crate::error::{Error, Result};
use crate::nn::params::ParamTable;
use crate::nn::trainable::Trainable;
use crate::train::metrics::EvalResult;
use crate::train::optim::{Optimizer, OptimizerKind, OptimizerState};
use crate::train::recipe::Recipe;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = "state.json";
/// Version of the checkpoint layout, stored in `state.json`. Format 2 added `checksum` and
/// `written_by`; format 3 holds the balancer's two-regime model (issue 27's rebuild).
pub const FORMAT: u32 = 3;
/// How random streams are derived (all keyed by integers, none stateful).
pub const RNG_SCHEME: &str = "keyed-xoshiro256**: init [seed, 0x1417, layer], epoch permutation [seed, 0xE90C, epoch], per-sample [seed, epoch, sample]";

/// Where a run stands between two iterations.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// Iterations completed; the next iteration has this 0-based index.
    pub step: usize,
    /// Epoch of the next iteration.
    pub epoch: usize,
    /// Global batches of `epoch` already done. It may equal the epoch's batch count: the epoch's
    /// end (balancer bookkeeping, evaluation) is then still to come.
    pub batch_in_epoch: usize,
    /// Sum and count of the per-iteration losses of `epoch` so far.
    pub epoch_loss: (f64, usize),
    /// Evaluations so far.
    pub evals: Vec<EvalResult>,
}

/// Random state: the seed, and the keyed-stream scheme that makes it sufficient.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RngState {
    pub seed: u64,
    pub scheme: String,
}

/// Size and sha256 of one file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    pub name: String,
    pub bytes: u64,
    pub sha256: String,
}

/// `state.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingState {
    pub format: u32,
    pub progress: Progress,
    pub world_size: usize,
    pub optimizer: OptimizerState,
    pub balancer: Balancer,
    pub rng: RngState,
    /// The resolved recipe, as TOML.
    pub recipe: String,
    pub files: Vec<FileDigest>,
    /// The lbbsp version that wrote it.
    #[serde(default)]
    pub written_by: String,
    /// sha256 of this state serialised with `checksum` empty (see [`state_json`]).
    #[serde(default)]
    pub checksum: String,
}

/// What [`save`] writes.
pub struct Snapshot<'a> {
    pub table: &'a ParamTable,
    pub params: &'a [f32],
    pub optimizer: &'a Optimizer,
    pub balancer: &'a Balancer,
    pub progress: &'a Progress,
    pub recipe: &'a Recipe,
    pub world_size: usize,
}

/// A checkpoint read back and verified.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub state: TrainingState,
    pub params: Vec<f32>,
    /// Optimizer buffers by name, each laid out like the parameters.
    pub buffers: Vec<(String, Vec<f32>)>,
}

fn err(path: impl Into<PathBuf>, msg: impl Into<String>) -> Error {
    Error::Checkpoint { path: path.into(), msg: msg.into() }
}

/// The folder of the checkpoint after `step` iterations.
pub fn step_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!("step-{step}"))
}

fn parse_step(name: &str) -> Option<usize> {
    name.strip_prefix("step-")?.parse().ok()
}

/// The `step-<n>` folders in `root`, newest first. A missing `root` has none.
pub fn list(root: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(root, e)),
    };
    let mut steps = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(root, e))?;
        if let Some(n) = entry.file_name().to_str().and_then(parse_step) {
            if entry.path().is_dir() {
                steps.push((n, entry.path()));
            }
        }
    }
    steps.sort_by_key(|s| std::cmp::Reverse(s.0));
    Ok(steps)
}

/// Whether `path` names one checkpoint (a `step-<n>` folder or one holding `state.json`) rather than
/// a folder of checkpoints.
pub fn is_step_dir(path: &Path) -> bool {
    path.join(STATE_FILE).is_file() || path.file_name().and_then(|n| n.to_str()).and_then(parse_step).is_some()
}

/// The folder of checkpoints `path` belongs to: `path` itself, or its parent for one checkpoint.
pub fn root_of(path: &Path) -> PathBuf {
    if is_step_dir(path) {
        path.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
    } else {
        path.to_path_buf()
    }
}

/// Checks that a fresh (not resumed) run may write checkpoints into `root`: it must not hold any
/// from an earlier run, which a later `--resume` could mix up with this run's.
pub fn check_fresh(root: &Path) -> Result<()> {
    if let Some((n, _)) = list(root)?.first() {
        return Err(err(
            root,
            format!("already holds checkpoints (newest step-{n}): continue that run with --resume, or choose an empty folder"),
        ));
    }
    Ok(())
}

// ---- Writing ----

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(|e| Error::io(path, e))?;
    f.write_all(bytes).map_err(|e| Error::io(path, e))?;
    f.sync_all().map_err(|e| Error::io(path, e))
}

fn sync_dir(path: &Path) -> Result<()> {
    File::open(path).and_then(|d| d.sync_all()).map_err(|e| Error::io(path, e))
}

fn digest(name: &str, bytes: &[u8]) -> FileDigest {
    FileDigest { name: name.to_string(), bytes: bytes.len() as u64, sha256: hex(&Sha256::digest(bytes)) }
}

/// Writes `snap` atomically as `root/step-<step>/` (replacing one of the same step) and returns
/// that folder. Called on one rank.
pub fn save(root: &Path, snap: &Snapshot<'_>) -> Result<PathBuf> {
    let step = snap.progress.step;
    let dest = step_dir(root, step);
    let model = snap.table.to_safetensors(&dest.join(MODEL_FILE), &[("", snap.params)])?;
    let opt = snap.table.to_safetensors(&dest.join(OPTIMIZER_FILE), &snap.optimizer.buffers())?;
    let state = TrainingState {
        format: FORMAT,
        progress: snap.progress.clone(),
        world_size: snap.world_size,
        optimizer: snap.optimizer.state(),
        balancer: snap.balancer.clone(),
        rng: RngState { seed: snap.recipe.train.seed, scheme: RNG_SCHEME.to_string() },
        recipe: snap.recipe.to_toml(),
        files: vec![digest(MODEL_FILE, &model), digest(OPTIMIZER_FILE, &opt)],
        written_by: env!("CARGO_PKG_VERSION").to_string(),
        checksum: String::new(),
    };
    let json = state_json(&dest.join(STATE_FILE), state)?;

    std::fs::create_dir_all(root).map_err(|e| Error::io(root, e))?;
    let pid = std::process::id();
    let tmp = root.join(format!(".step-{step}.tmp-{pid}"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir(&tmp).map_err(|e| Error::io(&tmp, e))?;
    write_synced(&tmp.join(MODEL_FILE), &model)?;
    write_synced(&tmp.join(OPTIMIZER_FILE), &opt)?;
    write_synced(&tmp.join(STATE_FILE), &json)?;
    sync_dir(&tmp)?;
    // A folder of the same step (left by an earlier, damaged attempt) is moved aside, not merged.
    let old = root.join(format!(".step-{step}.old-{pid}"));
    let replacing = dest.exists();
    if replacing {
        std::fs::rename(&dest, &old).map_err(|e| Error::io(&dest, e))?;
    }
    std::fs::rename(&tmp, &dest).map_err(|e| Error::io(&dest, e))?;
    sync_dir(root)?;
    if replacing {
        std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
    }
    Ok(dest)
}

// ---- Reading ----

/// Reads a file recorded in `state.files`, checking its size and sha256.
fn read_verified(dir: &Path, state: &TrainingState, name: &str) -> Result<Vec<u8>> {
    let path = dir.join(name);
    let rec = state
        .files
        .iter()
        .find(|f| f.name == name)
        .ok_or_else(|| err(dir.join(STATE_FILE), format!("lists no digest for {name}")))?;
    let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
    if bytes.len() as u64 != rec.bytes {
        return Err(err(
            &path,
            format!("truncated or corrupted: {} bytes, {STATE_FILE} records {}", bytes.len(), rec.bytes),
        ));
    }
    let actual = hex(&Sha256::digest(&bytes));
    if actual != rec.sha256 {
        return Err(err(&path, format!("corrupted: sha256 {actual}, {STATE_FILE} records {}", rec.sha256)));
    }
    Ok(bytes)
}

/// `state` as the bytes of `state.json`, its `checksum` set: the sha256 of the same
/// serialisation with `checksum` empty. Serialising what was read gives the same bytes (fields in
/// declaration order, floats round-trip exactly), which is how [`read_state`] checks it.
fn state_json(path: &Path, mut state: TrainingState) -> Result<Vec<u8>> {
    state.checksum = String::new();
    let bare = serde_json::to_vec_pretty(&state).map_err(|e| err(path, e.to_string()))?;
    state.checksum = hex(&Sha256::digest(&bare));
    serde_json::to_vec_pretty(&state).map_err(|e| err(path, e.to_string()))
}

/// Reads `dir/state.json`, checking its format and its own checksum.
pub fn read_state(dir: &Path) -> Result<TrainingState> {
    let path = dir.join(STATE_FILE);
    let text = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
    // The format first, alone: a state of another format may not parse as this one.
    #[derive(Deserialize)]
    struct Head {
        format: u32,
        #[serde(default)]
        written_by: String,
    }
    let head: Head = serde_json::from_slice(&text)
        .map_err(|e| err(&path, format!("not a valid training state ({e}): truncated or corrupted?")))?;
    if head.format != FORMAT {
        let by = if head.written_by.is_empty() {
            "an older lbbsp".to_string()
        } else {
            format!("lbbsp {}", head.written_by)
        };
        return Err(err(
            &path,
            format!(
                "checkpoint format {} (written by {by}) is not format {FORMAT}, the one lbbsp {} reads: resume it with \
                 the lbbsp that wrote it, or start afresh",
                head.format,
                env!("CARGO_PKG_VERSION")
            ),
        ));
    }
    let state: TrainingState = serde_json::from_slice(&text)
        .map_err(|e| err(&path, format!("not a valid training state ({e}): truncated or corrupted?")))?;
    let recorded = state.checksum.clone();
    let expected = state_json(&path, state.clone())?;
    if expected != text {
        return Err(err(
            &path,
            format!("corrupted or edited: its content does not match the sha256 {recorded} it records"),
        ));
    }
    Ok(state)
}

/// Removes all but the newest `keep` checkpoints in `root` (at least one is always kept).
pub fn keep_newest(root: &Path, keep: usize) -> Result<()> {
    for (_, dir) in list(root)?.into_iter().skip(keep.max(1)) {
        // Renamed out of the `step-<n>` namespace first, so a crash midway never leaves a
        // half-removed folder that looks like a checkpoint.
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        let doomed = root.join(format!(".{name}.removing-{}", std::process::id()));
        std::fs::rename(&dir, &doomed).map_err(|e| Error::io(&dir, e))?;
        std::fs::remove_dir_all(&doomed).map_err(|e| Error::io(&doomed, e))?;
    }
    Ok(())
}

/// Reads and verifies the checkpoint in `dir` for a model laid out as `table` and an optimizer with
/// the buffers `buffer_names`. Every failure names the file at fault.
pub fn load(dir: &Path, table: &ParamTable, buffer_names: &[&str]) -> Result<Checkpoint> {
    load_tensors(dir, read_state(dir)?, table, buffer_names)
}

fn load_tensors(dir: &Path, state: TrainingState, table: &ParamTable, buffer_names: &[&str]) -> Result<Checkpoint> {
    let model_path = dir.join(MODEL_FILE);
    let model = read_verified(dir, &state, MODEL_FILE)?;
    let params = table.from_safetensors(&model_path, &model, &[""])?.remove(0);
    let opt_path = dir.join(OPTIMIZER_FILE);
    let opt = read_verified(dir, &state, OPTIMIZER_FILE)?;
    let values = table.from_safetensors(&opt_path, &opt, buffer_names)?;
    let buffers = buffer_names.iter().map(|n| n.to_string()).zip(values).collect();
    Ok(Checkpoint { dir: dir.to_path_buf(), state, params, buffers })
}

/// The checkpoint `path` names: one step folder (which must be valid), or the newest valid one in a
/// folder of checkpoints. Also returns the errors of newer, damaged checkpoints skipped on the way.
///
/// `accept` sees each state before its tensors are read; its error (a checkpoint of another
/// recipe, say) is returned at once rather than skipped: an older checkpoint would not fit either.
pub fn load_latest(
    path: &Path,
    table: &ParamTable,
    buffer_names: &[&str],
    accept: impl Fn(&Path, &TrainingState) -> Result<()>,
) -> Result<(Checkpoint, Vec<Error>)> {
    if is_step_dir(path) {
        let state = read_state(path)?;
        accept(path, &state)?;
        return Ok((load_tensors(path, state, table, buffer_names)?, Vec::new()));
    }
    if !path.is_dir() {
        return Err(err(path, "no such checkpoint folder"));
    }
    let mut skipped = Vec::new();
    for (_, dir) in list(path)? {
        let state = match read_state(&dir) {
            Ok(state) => state,
            Err(e) => {
                skipped.push(e);
                continue;
            }
        };
        accept(&dir, &state)?;
        match load_tensors(&dir, state, table, buffer_names) {
            Ok(c) => return Ok((c, skipped)),
            Err(e) => skipped.push(e),
        }
    }
    let why = if skipped.is_empty() {
        "holds no checkpoint (step-<n> folder)".to_string()
    } else {
        let list: Vec<String> = skipped.iter().map(|e| format!("  {e}")).collect();
        format!("holds no valid checkpoint:\n{}", list.join("\n"))
    };
    Err(err(path, why))
}

/// The parameters in a weights file for a model laid out as `table`. When the file sits in a
/// checkpoint folder whose `state.json` records its digest, the digest is checked too.
pub fn read_weights(path: &Path, table: &ParamTable) -> Result<Vec<f32>> {
    let (path, dir) = if path.is_dir() {
        (path.join(MODEL_FILE), path.to_path_buf())
    } else {
        (path.to_path_buf(), path.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf))
    };
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
    let bytes = match read_state(&dir) {
        Ok(state) if state.files.iter().any(|f| f.name == name) => read_verified(&dir, &state, &name)?,
        _ => std::fs::read(&path).map_err(|e| Error::io(&path, e))?,
    };
    Ok(table.from_safetensors(&path, &bytes, &[""])?.remove(0))
}

/// Writes `params` alone as a safetensors file (atomically: temporary file, fsync, rename).
pub fn write_weights(path: &Path, table: &ParamTable, params: &[f32]) -> Result<()> {
    table.write_safetensors(path, &[("", params)])
}

// ---- Resuming on every rank ----

/// A checkpoint restored into a model and optimizer on every rank.
pub struct Resumed {
    pub dir: PathBuf,
    pub state: TrainingState,
}

/// Restores the checkpoint `path` names (see [`load_latest`]) into `model` and `opt` on every
/// rank. Rank 0 reads and verifies it, prints a warning naming each newer checkpoint it skips,
/// checks that it was written for the same data, model, global batch, seed and optimizer kind as
/// `recipe`, says which checkpoint it resumes from, and sends it to the others. An error on rank 0
/// leaves the others blocked in a collective: end the job on error.
pub fn resume<M: Trainable + ?Sized>(
    path: &Path,
    comm: &dyn Communicator,
    recipe: &Recipe,
    model: &mut M,
    opt: &mut Optimizer,
) -> Result<Resumed> {
    let names: Vec<&str> = opt.buffers().iter().map(|b| b.0).collect();
    let mut json = Vec::new();
    let loaded = if comm.rank() == 0 {
        let kind = opt.kind();
        let accept = |dir: &Path, state: &TrainingState| check_compatible(dir, state, recipe, kind);
        let (c, skipped) = load_latest(path, model.table(), &names, accept)?;
        for e in &skipped {
            eprintln!("warning: skipping checkpoint {}: {e}", e_dir(e).display());
        }
        let p = &c.state.progress;
        eprintln!(
            "lbbsp: resuming from {} (iteration {}, epoch {}, batch {} of the epoch)",
            c.dir.display(),
            p.step,
            p.epoch,
            p.batch_in_epoch
        );
        json = serde_json::to_vec(&(&c.dir, &c.state)).map_err(|e| err(c.dir.join(STATE_FILE), e.to_string()))?;
        Some(c)
    } else {
        None
    };
    let json = broadcast_bytes(comm, 0, json);
    let (dir, state): (PathBuf, TrainingState) =
        serde_json::from_slice(&json).map_err(|e| Error::Comm(format!("receiving the checkpoint: {e}")))?;
    if let Some(c) = &loaded {
        model.params_mut().copy_from_slice(&c.params);
        for ((_, dst), (_, src)) in opt.buffers_mut().into_iter().zip(&c.buffers) {
            dst.copy_from_slice(src);
        }
    }
    comm.broadcast_into(0, model.params_mut());
    for (_, buf) in opt.buffers_mut() {
        comm.broadcast_into(0, buf);
    }
    opt.set_step(state.optimizer.step);
    Ok(Resumed { dir, state })
}

/// The checkpoint folder an error of [`load`] is about (the file's parent).
fn e_dir(e: &Error) -> PathBuf {
    match e {
        Error::Checkpoint { path, .. } | Error::Io { path, .. } => {
            path.parent().map_or_else(|| path.clone(), Path::to_path_buf)
        }
        _ => PathBuf::new(),
    }
}

/// Refuses a checkpoint written for other data, another model, global batch or seed, or another
/// optimizer kind: its position and state would mean something else.
fn check_compatible(dir: &Path, state: &TrainingState, recipe: &Recipe, kind: OptimizerKind) -> Result<()> {
    let path = dir.join(STATE_FILE);
    let saved = Recipe::parse(&state.recipe, &path, &[])?;
    let differs = [
        ("data", saved.data != recipe.data),
        ("model", saved.model != recipe.model),
        ("train.global_batch", saved.train.global_batch != recipe.train.global_batch),
        ("train.seed", saved.train.seed != recipe.train.seed),
        ("optimizer.kind", state.optimizer.kind != kind),
    ];
    if let Some((field, _)) = differs.iter().find(|d| d.1) {
        return Err(err(
            path,
            format!("was written for a recipe with another `{field}` than this one; resume with the recipe it records"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balance::BalanceConfig;

    fn fixture() -> (Recipe, ParamTable, Vec<f32>, Optimizer) {
        let recipe = crate::train::recipe::resolve(
            "digits-mlp",
            &["optimizer.kind=\"adam\"".into(), "optimizer.momentum=0.0".into(), "optimizer.nesterov=false".into()],
        )
        .unwrap();
        let mut table = ParamTable::default();
        table.push("layers.1.weight", &[3, 4]);
        table.push("layers.1.bias", &[3]);
        let params: Vec<f32> = (0..table.len()).map(|i| i as f32 * 0.25 - 1.0).collect();
        let mut opt = Optimizer::new(&recipe.optimizer, table.len());
        let g: Vec<f32> = (0..table.len()).map(|i| (i as f32).sin()).collect();
        opt.step(&mut params.clone(), &g, 0.01);
        (recipe, table, params, opt)
    }

    fn write(root: &Path, step: usize) -> PathBuf {
        let (recipe, table, params, opt) = fixture();
        let balancer = Balancer::new(&BalanceConfig::default(), 64, 2).unwrap();
        let progress = Progress { step, epoch: 1, batch_in_epoch: 3, epoch_loss: (1.5, 3), evals: Vec::new() };
        let snap = Snapshot {
            table: &table,
            params: &params,
            optimizer: &opt,
            balancer: &balancer,
            progress: &progress,
            recipe: &recipe,
            world_size: 2,
        };
        save(root, &snap).unwrap()
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lbbsp-ckpt-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn round_trip_is_exact() {
        let root = scratch("roundtrip");
        let dir = write(&root, 7);
        assert_eq!(dir, root.join("step-7"));
        let (recipe, table, params, opt) = fixture();
        let c = load(&dir, &table, &["exp_avg", "exp_avg_sq"]).unwrap();
        assert_eq!(c.params, params);
        assert_eq!(c.buffers[0].1, opt.buffers()[0].1);
        assert_eq!(c.buffers[1].1, opt.buffers()[1].1);
        assert_eq!(c.state.optimizer, OptimizerState { kind: OptimizerKind::Adam, step: 1 });
        assert_eq!(c.state.progress.batch_in_epoch, 3);
        assert_eq!(Recipe::parse(&c.state.recipe, Path::new("x"), &[]).unwrap(), recipe);
        assert_eq!(read_weights(&dir.join(MODEL_FILE), &table).unwrap(), params);
        // Nothing but the step folders is left behind.
        let names: Vec<_> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["step-7"]);
        // Same content, same bytes.
        let again = write(&scratch("roundtrip2"), 7);
        assert_eq!(std::fs::read(dir.join(MODEL_FILE)).unwrap(), std::fs::read(again.join(MODEL_FILE)).unwrap());
    }

    #[test]
    fn state_json_carries_its_own_checksum() {
        let dir = write(&scratch("state-sum"), 3);
        let path = dir.join(STATE_FILE);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(read_state(&dir).unwrap().checksum.len() == 64);
        // One digit of the position changed, the file still valid JSON of the right shape.
        let edited = text.replacen("\"step\": 3", "\"step\": 4", 1);
        assert_ne!(edited, text);
        std::fs::write(&path, edited).unwrap();
        let e = read_state(&dir).unwrap_err().to_string();
        assert!(e.contains(path.to_str().unwrap()) && e.contains("corrupted or edited"), "{e}");
    }

    #[test]
    fn another_format_is_refused_by_name() {
        let dir = write(&scratch("format"), 3);
        let path = dir.join(STATE_FILE);
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, text.replacen(&format!("\"format\": {FORMAT}"), "\"format\": 1", 1)).unwrap();
        let e = read_state(&dir).unwrap_err().to_string();
        let want = format!("checkpoint format 1 (written by lbbsp {})", env!("CARGO_PKG_VERSION"));
        assert!(e.contains(&want) && e.contains(&format!("not format {FORMAT}")), "{e}");
    }

    #[test]
    fn keep_newest_removes_the_oldest_only() {
        let root = scratch("keep");
        for step in [5, 10, 15, 20] {
            write(&root, step);
        }
        keep_newest(&root, 2).unwrap();
        let steps: Vec<usize> = list(&root).unwrap().into_iter().map(|s| s.0).collect();
        assert_eq!(steps, [20, 15]);
        let names: Vec<_> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 2, "nothing else left behind: {names:?}");
        keep_newest(&root, 0).unwrap();
        assert_eq!(list(&root).unwrap().len(), 1, "the newest is always kept");
    }

    #[test]
    fn damaged_newest_is_skipped_and_named() {
        let root = scratch("damaged");
        write(&root, 10);
        let newest = write(&root, 20);
        let (_, table, _, _) = fixture();
        let names = ["exp_avg", "exp_avg_sq"];
        let f = newest.join(MODEL_FILE);
        let bytes = std::fs::read(&f).unwrap();
        std::fs::write(&f, &bytes[..bytes.len() - 5]).unwrap();
        let e = load(&newest, &table, &names).unwrap_err().to_string();
        assert!(e.contains(f.to_str().unwrap()) && e.contains("truncated"), "{e}");
        let (c, skipped) = load_latest(&root, &table, &names, |_, _| Ok(())).unwrap();
        assert_eq!(c.state.progress.step, 10);
        assert_eq!(skipped.len(), 1);
        // A flipped byte of the same length is caught by the digest.
        let mut flipped = bytes.clone();
        let k = flipped.len() - 1;
        flipped[k] ^= 1;
        std::fs::write(&f, &flipped).unwrap();
        let e = load_latest(&newest, &table, &names, |_, _| Ok(())).unwrap_err().to_string();
        assert!(e.contains(f.to_str().unwrap()) && e.contains("sha256"), "{e}");
        // A garbled state file is named too.
        std::fs::write(newest.join(STATE_FILE), "{\"format\": 1, \"progr").unwrap();
        let e = load(&newest, &table, &names).unwrap_err().to_string();
        assert!(e.contains(STATE_FILE), "{e}");
    }

    #[test]
    fn wrong_shapes_and_names_are_refused() {
        let root = scratch("shapes");
        let dir = write(&root, 1);
        let mut other = ParamTable::default();
        other.push("layers.1.weight", &[4, 3]);
        other.push("layers.1.bias", &[3]);
        let e = read_weights(&dir.join(MODEL_FILE), &other).unwrap_err().to_string();
        assert!(e.contains("layers.1.weight") && e.contains("[4, 3]"), "{e}");
        let mut more = ParamTable::default();
        more.push("layers.1.weight", &[3, 4]);
        more.push("layers.1.bias", &[3]);
        more.push("layers.3.bias", &[2]);
        let e = read_weights(&dir.join(MODEL_FILE), &more).unwrap_err().to_string();
        assert!(e.contains("layers.3.bias"), "{e}");
    }

    #[test]
    fn fresh_runs_refuse_a_used_folder() {
        let root = scratch("fresh");
        check_fresh(&root).unwrap();
        write(&root, 3);
        let e = check_fresh(&root).unwrap_err().to_string();
        assert!(e.contains("step-3") && e.contains("--resume"), "{e}");
        assert!(is_step_dir(&root.join("step-3")) && !is_step_dir(&root));
        assert_eq!(root_of(&root.join("step-3")), root);
    }
}
