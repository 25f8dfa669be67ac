//! Typed errors of the library. Every variant names the file, field or setting at fault and, where
//! there is one, the fix.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A data file is present but its content is wrong (truncated, bad magic, malformed token...).
    #[error("{path}: {msg}")]
    Data { path: PathBuf, msg: String },
    #[error("{path}: checksum mismatch (sha256 {actual}, expected {expected}); the file is corrupt or a different version: delete it and run `lbbsp data fetch {dataset}`")]
    Checksum { path: PathBuf, dataset: String, expected: String, actual: String },
    #[error("missing data file {path}: run `lbbsp data fetch {dataset}` (with internet), or `lbbsp data fetch {dataset} --mirror DIR` from a local copy, or point --data-dir / LBBSP_DATA at a folder that holds it")]
    MissingData { path: PathBuf, dataset: String },
    #[error("could not download {dataset}: {msg}")]
    Fetch { dataset: String, msg: String },
    /// The recipe file could not be read or parsed; `msg` quotes the offending key.
    #[error("recipe {path}: {msg}")]
    Recipe { path: PathBuf, msg: String },
    /// A configuration value is impossible; `field` is its dotted recipe path.
    #[error("`{field}`: {msg}")]
    Config { field: String, msg: String },
    #[error("communicator: {0}")]
    Comm(String),
    /// Ranks were launched differently (recipe, build, data, world). Every rank returns it, with
    /// the same verdict, so none is left waiting and one report suffices.
    #[error("the ranks were not launched alike: {0}")]
    Mismatch(String),
    /// An error of one rank's that every rank was told of (see `dist::comm::share_outcome`).
    #[error("on rank {rank}: {msg}")]
    OnRank { rank: usize, msg: String },
    #[error("{path}: {msg}")]
    Output { path: PathBuf, msg: String },
    /// A checkpoint or weights file is missing, damaged, or was written for another model.
    #[error("{path}: {msg}")]
    Checkpoint { path: PathBuf, msg: String },
    /// A parameter name that a model's table does not hold; `known` lists the names it does, with
    /// their shapes.
    #[error("the model has no parameter `{name}`; its parameters are {known}")]
    UnknownParam { name: String, known: String },
    /// A model given to `Run::with_model` does not fit the run: `what` names the quantity
    /// (`input size`, `classes`, `capacity`), `model` what the model has and `run` what the run
    /// needs.
    #[error("the model's {what} is {model}, but {run}: build the model for the run's data set and batch bounds")]
    ModelMismatch { what: &'static str, model: String, run: String },
    /// The training loss became NaN or infinite: every later step would be wasted.
    #[error(
        "training diverged at iteration {iter}: the loss is {loss} at learning rate {lr}; lower `optimizer.lr`, \
         set `optimizer.clip_grad_norm`, or raise `train.global_batch` (the metrics up to this iteration are \
         written; no checkpoint is written for it)"
    )]
    Diverged { iter: usize, loss: f64, lr: f32 },
    /// A stop signal (`runtime.stop_signals`, named in `signal`) ended the run after `iterations`
    /// iterations, every rank at the same one, with a checkpoint written where there is a
    /// checkpoint folder. The command line exits with status 75 (the train module's
    /// `stop::PREEMPTED_STATUS`).
    #[error("stopped by {signal} after iteration {iterations}: {saved}")]
    Preempted { signal: String, iterations: usize, saved: String },
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
    pub fn data(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Data { path: path.into(), msg: msg.into() }
    }
    pub fn config(field: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Config { field: field.into(), msg: msg.into() }
    }
    /// Whether every rank returns this error at the same point with the same text (a collective
    /// verdict): one rank's report is then enough and no rank needs aborting.
    pub fn is_collective(&self) -> bool {
        matches!(self, Error::Mismatch(_) | Error::Diverged { .. } | Error::OnRank { .. } | Error::Preempted { .. })
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Serialises a type as its `Display` text and deserialises it through its `FromStr`: for settings
/// a recipe writes as a name or a short syntax (`isa = "avx2"`, `slowdown = ["1:3.0@30"]`), so the
/// parse error names what is wrong and how to write it.
macro_rules! serde_as_string {
    ($t:ty) => {
        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                let text = <String as serde::Deserialize>::deserialize(d)?;
                text.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}
pub(crate) use serde_as_string;
