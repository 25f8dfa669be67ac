//! Preemption: a stop signal ends a run after an iteration that every rank agrees on, with a
//! checkpoint, and the process exits with [`PREEMPTED_STATUS`].
//!
//! A scheduler warns a job it is about to take back with a signal: Slurm sends SIGTERM before it
//! preempts or cancels a job, and the signal `--signal` names (SIGUSR1 unless told otherwise)
//! before its time limit; a terminal sends SIGINT. The handler only records the first signal.
//! Each rank writes what it has recorded into the stats that ride with its gradient
//! (`crate::dist::sync::RankStats::stop`), so a signal that reached any one rank is known to every
//! rank from the same gathered stats, and all stop after the same iteration without a collective
//! of their own. A second stop signal exits the process at once with status 128 + its number:
//! checkpoints are written atomically, so the one before stays whole.

use crate::error::{serde_as_string, Error, Result};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Mutex;

/// The exit status of a run that a stop signal ended after writing its checkpoint: "preempted,
/// requeue me", as against 1 (failed). It is `EX_TEMPFAIL` of sysexits.h (a temporary failure:
/// try again).
pub const PREEMPTED_STATUS: i32 = 75;

/// A signal that asks a run to stop: `TERM`, `INT`, `USR1`, `USR2` or `HUP` in a recipe (with or
/// without the `SIG` prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopSignal(i32);

const NAMES: [(&str, i32); 5] = [
    ("TERM", libc::SIGTERM),
    ("INT", libc::SIGINT),
    ("USR1", libc::SIGUSR1),
    ("USR2", libc::SIGUSR2),
    ("HUP", libc::SIGHUP),
];

impl StopSignal {
    pub const TERM: StopSignal = StopSignal(libc::SIGTERM);
    pub const INT: StopSignal = StopSignal(libc::SIGINT);
    pub const USR1: StopSignal = StopSignal(libc::SIGUSR1);

    /// The signal's number.
    pub fn number(self) -> i32 {
        self.0
    }

    /// The signal numbered `n`, if it is one of the stop signals.
    pub fn from_number(n: i32) -> Option<StopSignal> {
        NAMES.iter().any(|&(_, k)| k == n).then_some(StopSignal(n))
    }

    /// Slurm's usual ones: SIGTERM (preemption, `scancel`), SIGUSR1 (`--signal`'s default) and
    /// SIGINT (a terminal, `srun` passing on Ctrl-C).
    pub fn defaults() -> Vec<StopSignal> {
        vec![StopSignal::TERM, StopSignal::USR1, StopSignal::INT]
    }
}

impl std::fmt::Display for StopSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = NAMES.iter().find(|n| n.1 == self.0).map_or("?", |n| n.0);
        write!(f, "SIG{name}")
    }
}

impl std::str::FromStr for StopSignal {
    type Err = Error;
    fn from_str(s: &str) -> Result<StopSignal> {
        let upper = s.trim().to_ascii_uppercase();
        let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
        NAMES.iter().find(|n| n.0 == bare).map(|n| StopSignal(n.1)).ok_or_else(|| {
            Error::config("runtime.stop_signals", format!("unknown signal `{s}`: use TERM, INT, USR1, USR2 or HUP"))
        })
    }
}

serde_as_string!(StopSignal);

/// The first stop signal this process received since the handlers went in (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);

/// How many [`Handlers`] are alive, and the dispositions the first one replaced.
static INSTALLED: Mutex<(usize, Vec<(i32, libc::sigaction)>)> = Mutex::new((0, Vec::new()));

extern "C" fn on_signal(sig: libc::c_int) {
    if RECEIVED.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst).is_err() {
        let msg = b"lbbsp: a second stop signal: exiting now; the last checkpoint written is whole\n";
        // SAFETY: write(2) and _exit(2) are async-signal-safe.
        unsafe {
            libc::write(2, msg.as_ptr().cast(), msg.len());
            libc::_exit(128 + sig);
        }
    }
}

/// The stop-signal handlers of this process while alive; the dispositions they replaced come
/// back when the last one is dropped. Runs in one process share the first one's signals.
pub struct Handlers {
    _private: (),
}

impl Handlers {
    /// Installs the handler for each of `signals` that has none yet. The first of the live
    /// handlers clears what an earlier run received.
    pub fn install(signals: &[StopSignal]) -> Result<Handlers> {
        let mut installed = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
        if installed.0 == 0 {
            RECEIVED.store(0, Ordering::SeqCst);
        }
        for s in signals {
            if installed.1.iter().any(|(sig, _)| *sig == s.0) {
                continue;
            }
            // SAFETY: sigaction with a handler that only touches an atomic (or exits); the old
            // disposition is kept to be restored.
            let old = unsafe {
                let mut new: libc::sigaction = std::mem::zeroed();
                new.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
                new.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut new.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(s.0, &new, &mut old) != 0 {
                    let e = std::io::Error::last_os_error();
                    return Err(Error::config("runtime.stop_signals", format!("cannot handle {s}: {e}")));
                }
                old
            };
            installed.1.push((s.0, old));
        }
        installed.0 += 1;
        Ok(Handlers { _private: () })
    }
}

impl Drop for Handlers {
    fn drop(&mut self) {
        let mut installed = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
        installed.0 -= 1;
        if installed.0 == 0 {
            for (sig, old) in installed.1.drain(..) {
                // SAFETY: puts back the disposition `install` replaced.
                unsafe { libc::sigaction(sig, &old, std::ptr::null_mut()) };
            }
        }
    }
}

/// The first stop signal this process received while [`Handlers`] were installed.
pub fn received() -> Option<StopSignal> {
    StopSignal::from_number(RECEIVED.load(Ordering::SeqCst))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_print_and_refuse_by_field() {
        for (text, want) in [("TERM", "SIGTERM"), ("sigusr1", "SIGUSR1"), (" INT ", "SIGINT"), ("HUP", "SIGHUP")] {
            assert_eq!(text.parse::<StopSignal>().unwrap().to_string(), want);
        }
        let e = "KILL".parse::<StopSignal>().unwrap_err().to_string();
        assert!(e.contains("runtime.stop_signals") && e.contains("`KILL`") && e.contains("USR1"), "{e}");
        assert_eq!(StopSignal::from_number(libc::SIGKILL), None);
    }

    #[test]
    fn a_signal_is_recorded_and_the_old_disposition_comes_back() {
        // SIGUSR2 only: the test harness's other tests neither send nor handle it.
        let h = Handlers::install(&[StopSignal(libc::SIGUSR2)]).unwrap();
        assert_eq!(received(), None);
        // SAFETY: raise(3) of a signal whose handler is installed above.
        unsafe { libc::raise(libc::SIGUSR2) };
        assert_eq!(received(), Some(StopSignal(libc::SIGUSR2)));
        drop(h);
        // SAFETY: reads the current disposition only.
        let now = unsafe {
            let mut cur: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGUSR2, std::ptr::null(), &mut cur);
            cur.sa_sigaction
        };
        assert_eq!(now, libc::SIG_DFL, "the default disposition is back");
    }
}
