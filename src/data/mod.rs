//! Data sets: the manifest of known sets and their checksums, fetching, the IDX, CSV and LIBSVM
//! readers, the in-memory [`dataset::Dataset`], and the seeded random streams ([`rng`]).

pub mod csv;
pub mod dataset;
pub mod fetch;
pub mod idx;
pub mod libsvm;
pub mod load;
pub mod manifest;
pub mod rng;
