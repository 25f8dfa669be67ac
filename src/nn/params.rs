//! The flat parameter store: every parameter of a model lives in one `Vec<f32>`, every gradient in
//! another of the same length, and a small table maps names to `{shape, offset}`.
//!
//! One buffer means one broadcast at start-up, one allreduce per iteration, one optimizer loop and one
//! checkpoint slice, with no packing step (as in llm.c's `malloc_and_point_parameters`).

use serde::{Deserialize, Serialize};
use std::ops::Range;

/// One named tensor inside the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamEntry {
    /// Dotted name, e.g. `layers.1.weight`.
    pub name: String,
    pub shape: Vec<usize>,
    pub offset: usize,
}

impl ParamEntry {
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len()
    }
}

/// Name → shape/offset table of a flat parameter buffer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamTable {
    entries: Vec<ParamEntry>,
    total: usize,
}

impl ParamTable {
    /// Appends a tensor and returns its range in the flat buffer.
    pub fn push(&mut self, name: impl Into<String>, shape: &[usize]) -> Range<usize> {
        let entry = ParamEntry { name: name.into(), shape: shape.to_vec(), offset: self.total };
        self.total += entry.len();
        let r = entry.range();
        self.entries.push(entry);
        r
    }
    /// Total number of scalars.
    pub fn len(&self) -> usize {
        self.total
    }
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }
    pub fn entries(&self) -> &[ParamEntry] {
        &self.entries
    }
    pub fn get(&self, name: &str) -> Option<&ParamEntry> {
        self.entries.iter().find(|e| e.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_are_contiguous() {
        let mut t = ParamTable::default();
        assert_eq!(t.push("a.weight", &[3, 4]), 0..12);
        assert_eq!(t.push("a.bias", &[3]), 12..15);
        assert_eq!(t.len(), 15);
        assert_eq!(t.get("a.bias").unwrap().offset, 12);
    }
}
