//! Aids to reproduce or force a run's timing: the batch sizes of an earlier run
//! (`balance.replay`) and a deterministically slowed rank (`--slowdown`).

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Test aid: stretch one rank's compute time by `factor` from iteration `from_iter` on (it waits
/// `(factor − 1) ×` its measured compute time), to make a deterministic straggler; with `every`
/// above 1, only every `every`-th iteration from there (2: a rank whose speed alternates).
/// Written `RANK:FACTOR[@ITER][%EVERY]` (`1:3.0@30`, `1:4@0%2`) in `runtime.slowdown` and on the
/// command line.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slowdown {
    pub rank: usize,
    pub factor: f64,
    pub from_iter: usize,
    pub every: usize,
}

impl Slowdown {
    /// Whether iteration `iter` of `rank` is slowed.
    pub fn applies(&self, rank: usize, iter: usize) -> bool {
        self.rank == rank && iter >= self.from_iter && (iter - self.from_iter).is_multiple_of(self.every)
    }
}

impl std::str::FromStr for Slowdown {
    type Err = Error;
    fn from_str(s: &str) -> Result<Slowdown> {
        let err = |msg: String| Error::config("runtime.slowdown", msg);
        let syntax = || err(format!("`{s}`: expected RANK:FACTOR[@ITER][%EVERY], e.g. 1:3.0@30 or 1:4@0%2"));
        let (rank, rest) = s.split_once(':').ok_or_else(syntax)?;
        let (rest, every) = rest.split_once('%').unwrap_or((rest, "1"));
        let (factor, from) = rest.split_once('@').unwrap_or((rest, "0"));
        let sd = Slowdown {
            rank: rank.parse().map_err(|_| syntax())?,
            factor: factor.parse().map_err(|_| syntax())?,
            from_iter: from.parse().map_err(|_| syntax())?,
            every: every.parse().map_err(|_| syntax())?,
        };
        if !(sd.factor >= 1.0 && sd.factor.is_finite()) {
            return Err(err(format!("`{s}`: FACTOR must be ≥ 1")));
        }
        if sd.every == 0 {
            return Err(err(format!("`{s}`: EVERY must be ≥ 1")));
        }
        Ok(sd)
    }
}

impl std::fmt::Display for Slowdown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}@{}", self.rank, self.factor, self.from_iter)?;
        if self.every != 1 {
            write!(f, "%{}", self.every)?;
        }
        Ok(())
    }
}

crate::error::serde_as_string!(Slowdown);

/// Checks that every slowed rank exists in a world of `world`.
pub fn check_slowdowns(slowdowns: &[Slowdown], world: usize) -> Result<()> {
    match slowdowns.iter().find(|s| s.rank >= world) {
        Some(s) => {
            Err(Error::config("runtime.slowdown", format!("{s}: rank {} does not exist in a world of {world}", s.rank)))
        }
        None => Ok(()),
    }
}

/// The batch sizes of an earlier run (`balance.replay`), by iteration.
pub(crate) struct Replay {
    path: PathBuf,
    sizes: Vec<Vec<usize>>,
}

impl Replay {
    pub(crate) fn read(path: &Path, world: usize, global_batch: usize) -> Result<Replay> {
        let records = crate::train::metrics::read_records(path)?;
        let mut sizes = Vec::with_capacity(records.len());
        for (i, r) in records.iter().enumerate() {
            if r.iter != i {
                let msg = format!(
                    "record {} is iteration {}: the file must hold iterations 0, 1, 2, … in order",
                    i + 1,
                    r.iter
                );
                return Err(Error::data(path, msg));
            }
            if r.batch_sizes.len() != world || r.global_batch > global_batch {
                let msg = format!(
                    "iteration {i} split B = {} over {} rank(s); this run has B = {global_batch} on {world} rank(s) \
                     (balance.replay needs a run of the same recipe on as many ranks)",
                    r.global_batch,
                    r.batch_sizes.len()
                );
                return Err(Error::data(path, msg));
            }
            sizes.push(r.batch_sizes.clone());
        }
        Ok(Replay { path: path.to_path_buf(), sizes })
    }

    /// The sizes of iteration `iter`, whose batch holds `batch` samples.
    pub(crate) fn sizes(&self, iter: usize, batch: usize) -> Result<Vec<usize>> {
        match self.sizes.get(iter) {
            Some(s) if s.iter().sum::<usize>() == batch => Ok(s.clone()),
            Some(s) => Err(Error::data(
                &self.path,
                format!("iteration {iter} split {} samples, this run's batch has {batch}", s.iter().sum::<usize>()),
            )),
            None => Err(Error::data(
                &self.path,
                format!(
                    "holds {} iterations, this run reached iteration {iter}: replay a run at least as long",
                    self.sizes.len()
                ),
            )),
        }
    }
}

/// Stretches this rank's compute time of iteration `iter` (which took `took`) as `slowdowns` say.
pub(crate) fn stretch(slowdowns: &[Slowdown], rank: usize, iter: usize, took: Duration) {
    for s in slowdowns {
        if s.applies(rank, iter) && s.factor > 1.0 {
            // Sleep most of the extra time (freeing the core, as a rank descheduled by a co-located
            // job would), then spin to the deadline: waking an idle (virtual) CPU can take a
            // millisecond or more, a fixed cost the factor does not ask for.
            let deadline = Instant::now() + took.mul_f64(s.factor - 1.0);
            if let Some(nap) = deadline.checked_duration_since(Instant::now() + Duration::from_millis(2)) {
                std::thread::sleep(nap);
            }
            while Instant::now() < deadline {
                std::hint::spin_loop();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_periodic_slowdown_parses_applies_and_round_trips() {
        let s: Slowdown = "1:4@3%2".parse().unwrap();
        assert_eq!(s, Slowdown { rank: 1, factor: 4.0, from_iter: 3, every: 2 });
        let on: Vec<usize> = (0..9).filter(|&t| s.applies(1, t)).collect();
        assert_eq!(on, [3, 5, 7]);
        assert!(!s.applies(0, 3));
        assert_eq!(s.to_string().parse::<Slowdown>().unwrap(), s);
        assert_eq!("1:2".parse::<Slowdown>().unwrap().to_string(), "1:2@0");
        let e = "1:2@0%0".parse::<Slowdown>().unwrap_err().to_string();
        assert!(e.contains("EVERY must be ≥ 1"), "{e}");
    }
}
