//! The flat parameter store: every parameter of a model lives in one `Vec<f32>`, every gradient in
//! another of the same length, and a small table maps names to `{shape, offset}`.
//!
//! One buffer means one broadcast at start-up, one allreduce per iteration, one optimizer loop and one
//! checkpoint slice, with no packing step (as in llm.c's `malloc_and_point_parameters`).
//!
//! Users see tensors, not offsets: [`ParamTable::view`] and [`ParamTable::views`] lend any buffer
//! laid out by the table (parameters, gradients, an optimizer's moments) as ndarray views of each
//! tensor's shape, without copying, and [`ParamTable::to_safetensors`] /
//! [`ParamTable::from_safetensors`] write and read such buffers as safetensors files under the
//! same names.

use crate::error::{Error, Result};
use ndarray::{ArrayViewD, ArrayViewMutD, IxDyn};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::path::Path;

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

    /// The entry `name`, or an error listing the names (and shapes) the table holds.
    pub fn entry(&self, name: &str) -> Result<&ParamEntry> {
        self.get(name).ok_or_else(|| {
            let known: Vec<String> = self.entries.iter().map(|e| format!("`{}` {:?}", e.name, e.shape)).collect();
            Error::UnknownParam { name: name.to_string(), known: known.join(", ") }
        })
    }

    /// Tensor `name` of `buf` (a buffer laid out by this table) as a view of its shape.
    pub fn view<'a>(&self, buf: &'a [f32], name: &str) -> Result<ArrayViewD<'a, f32>> {
        self.check_layout(buf.len());
        let e = self.entry(name)?;
        Ok(shaped(e, &buf[e.range()]))
    }

    /// Tensor `name` of `buf` as a mutable view of its shape: writes land in `buf`.
    pub fn view_mut<'a>(&self, buf: &'a mut [f32], name: &str) -> Result<ArrayViewMutD<'a, f32>> {
        self.check_layout(buf.len());
        let e = self.entry(name)?;
        Ok(shaped_mut(e, &mut buf[e.range()]))
    }

    /// Every tensor of `buf` with its name, in table order.
    pub fn views<'a>(&'a self, buf: &'a [f32]) -> impl Iterator<Item = (&'a str, ArrayViewD<'a, f32>)> {
        self.check_layout(buf.len());
        self.entries.iter().map(move |e| (e.name.as_str(), shaped(e, &buf[e.range()])))
    }

    /// Every tensor of `buf` with its name, mutably, in table order.
    pub fn views_mut<'a>(&'a self, buf: &'a mut [f32]) -> impl Iterator<Item = (&'a str, ArrayViewMutD<'a, f32>)> {
        self.check_layout(buf.len());
        // The entries tile the buffer in order, so each takes the next piece of what is left.
        let mut rest = buf;
        self.entries.iter().map(move |e| {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(e.len());
            rest = tail;
            (e.name.as_str(), shaped_mut(e, head))
        })
    }

    /// A buffer of another length is not laid out by this table: a caller's bug, like a layer fed
    /// the wrong width.
    fn check_layout(&self, len: usize) {
        assert_eq!(len, self.total, "a buffer of {len} values is not laid out by this table of {} values", self.total);
    }
}

/// `values` (entry `e`'s piece of a buffer) in `e`'s shape.
fn shaped<'a>(e: &ParamEntry, values: &'a [f32]) -> ArrayViewD<'a, f32> {
    ArrayViewD::from_shape(IxDyn(&e.shape), values).expect("an entry's piece holds its shape")
}

fn shaped_mut<'a>(e: &ParamEntry, values: &'a mut [f32]) -> ArrayViewMutD<'a, f32> {
    ArrayViewMutD::from_shape(IxDyn(&e.shape), values).expect("an entry's piece holds its shape")
}

// ---- safetensors ----

/// The tensor of parameter `param` in the buffer `prefix`: `prefix.param`, or `param` alone.
fn tensor_name(prefix: &str, param: &str) -> String {
    if prefix.is_empty() {
        param.to_string()
    } else {
        format!("{prefix}.{param}")
    }
}

fn file_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::Checkpoint { path: path.to_path_buf(), msg: msg.into() }
}

/// The fix for a file whose tensors do not match the table.
const OTHER_MODEL: &str = "was it written for another model? It must hold exactly the model's tensors, by name and \
                           shape (`ParamTable::entries`), as F32";

impl ParamTable {
    /// `buffers` (each laid out by this table) as the bytes of one safetensors file: the tensor of
    /// parameter `p` in buffer `prefix` is `prefix.p` (`p` for an empty prefix), F32 in `p`'s shape.
    /// `path` is the file the bytes are for, named in errors.
    pub fn to_safetensors(&self, path: &Path, buffers: &[(&str, &[f32])]) -> Result<Vec<u8>> {
        let bytes: Vec<Vec<u8>> =
            buffers.iter().map(|(_, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
        let mut views = Vec::new();
        for ((prefix, values), raw) in buffers.iter().zip(&bytes) {
            assert_eq!(values.len(), self.total, "buffer `{prefix}` is not laid out by this table");
            for e in &self.entries {
                let name = tensor_name(prefix, &e.name);
                let view = TensorView::new(Dtype::F32, e.shape.clone(), &raw[4 * e.offset..4 * (e.offset + e.len())])
                    .map_err(|x| file_err(path, format!("tensor `{name}`: {x}")))?;
                views.push((name, view));
            }
        }
        // One metadata key only: the header stays byte-identical between runs (a map's order is not).
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize(views, Some(meta)).map_err(|x| file_err(path, x.to_string()))
    }

    /// Decodes the safetensors file `bytes` (read from `path`) into one buffer laid out by this
    /// table per prefix: buffer `prefix` takes the tensors `prefix.<parameter>`. The file must hold
    /// exactly those tensors, as F32 in the table's shapes; anything else is an error naming the
    /// file and the tensor.
    pub fn from_safetensors(&self, path: &Path, bytes: &[u8], prefixes: &[&str]) -> Result<Vec<Vec<f32>>> {
        let st = SafeTensors::deserialize(bytes)
            .map_err(|e| file_err(path, format!("not a valid safetensors file ({e}): truncated or corrupted?")))?;
        let mut out = Vec::with_capacity(prefixes.len());
        for prefix in prefixes {
            let mut flat = vec![0.0f32; self.total];
            for e in &self.entries {
                let name = tensor_name(prefix, &e.name);
                let t = st.tensor(&name).map_err(|_| {
                    file_err(
                        path,
                        format!("has no tensor `{name}` (F32 {:?}), which the model needs; {OTHER_MODEL}", e.shape),
                    )
                })?;
                if t.dtype() != Dtype::F32 {
                    let msg = format!(
                        "tensor `{name}` is {:?}, the model needs F32: convert it before saving (numpy \
                         `.astype(np.float32)`, PyTorch `.float()`)",
                        t.dtype()
                    );
                    return Err(file_err(path, msg));
                }
                if t.shape() != e.shape.as_slice() {
                    let msg = format!(
                        "tensor `{name}` has shape {:?}, the model needs {:?}; {OTHER_MODEL}",
                        t.shape(),
                        e.shape
                    );
                    return Err(file_err(path, msg));
                }
                for (v, c) in flat[e.range()].iter_mut().zip(t.data().chunks_exact(4)) {
                    *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            out.push(flat);
        }
        let known: BTreeSet<String> =
            prefixes.iter().flat_map(|p| self.entries.iter().map(|e| tensor_name(p, &e.name))).collect();
        let extra: BTreeSet<&str> = st.names().into_iter().filter(|n| !known.contains(*n)).collect();
        if let Some(first) = extra.first() {
            let more = if extra.len() > 1 { format!(" (and {} more)", extra.len() - 1) } else { String::new() };
            return Err(file_err(
                path,
                format!("holds tensor `{first}`{more}, which the model does not have; {OTHER_MODEL}"),
            ));
        }
        Ok(out)
    }

    /// Writes `buffers` as the safetensors file `path` (see [`ParamTable::to_safetensors`]),
    /// atomically: a temporary file beside it, fsynced, then renamed over it.
    pub fn write_safetensors(&self, path: &Path, buffers: &[(&str, &[f32])]) -> Result<()> {
        let bytes = self.to_safetensors(path, buffers)?;
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        let mut f = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        f.write_all(&bytes).and_then(|()| f.sync_all()).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
    }

    /// Reads the safetensors file `path` into buffers laid out by this table (see
    /// [`ParamTable::from_safetensors`]).
    pub fn read_safetensors(&self, path: &Path, prefixes: &[&str]) -> Result<Vec<Vec<f32>>> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        self.from_safetensors(path, &bytes, prefixes)
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

    /// `a.weight [2, 3]` at 0..6 and `a.bias [3]` at 6..9, over the buffer `0, 1, …, 8`.
    fn two() -> (ParamTable, Vec<f32>) {
        let mut t = ParamTable::default();
        t.push("a.weight", &[2, 3]);
        t.push("a.bias", &[3]);
        let buf = (0..9).map(|i| i as f32).collect();
        (t, buf)
    }

    #[test]
    fn views_read_the_buffer_at_each_offset_in_each_shape() {
        let (t, mut buf) = two();
        let w = t.view(&buf, "a.weight").unwrap();
        assert_eq!(w.shape(), [2, 3]);
        assert_eq!(w[[1, 0]], 3.0);
        let b = t.view(&buf, "a.bias").unwrap();
        assert_eq!(b.shape(), [3]);
        assert_eq!(b.as_slice().unwrap(), [6.0, 7.0, 8.0]);
        t.view_mut(&mut buf, "a.weight").unwrap()[[1, 2]] = -1.0;
        assert_eq!(buf[5], -1.0);
        let named: Vec<(&str, Vec<usize>, f32)> =
            t.views(&buf).map(|(n, v)| (n, v.shape().to_vec(), v.sum())).collect();
        assert_eq!(named, [("a.weight", vec![2, 3], 9.0), ("a.bias", vec![3], 21.0)]);
        for (name, mut v) in t.views_mut(&mut buf) {
            v.fill(if name == "a.bias" { 0.5 } else { 2.0 });
        }
        assert_eq!(buf, [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 0.5, 0.5, 0.5]);
    }

    #[test]
    fn an_unknown_name_is_an_error_listing_the_known_ones() {
        let (t, buf) = two();
        let e = t.view(&buf, "a.weights").unwrap_err();
        assert!(matches!(&e, Error::UnknownParam { name, .. } if name == "a.weights"), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("`a.weights`") && e.contains("`a.weight` [2, 3], `a.bias` [3]"), "{e}");
    }

    #[test]
    #[should_panic(expected = "not laid out by this table")]
    fn a_buffer_of_another_length_is_refused() {
        let (t, buf) = two();
        let _ = t.view(&buf[..8], "a.bias");
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("lbbsp-params-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn safetensors_round_trip_by_name() {
        let (t, buf) = two();
        let moment: Vec<f32> = buf.iter().map(|v| -v).collect();
        let path = scratch("roundtrip").join("w.safetensors");
        t.write_safetensors(&path, &[("", &buf), ("m", &moment)]).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut names = st.names();
        names.sort();
        assert_eq!(names, ["a.bias", "a.weight", "m.a.bias", "m.a.weight"]);
        assert_eq!(st.tensor("m.a.weight").unwrap().shape(), [2, 3]);
        // Same content, same bytes.
        assert_eq!(t.to_safetensors(&path, &[("", &buf), ("m", &moment)]).unwrap(), bytes);
        assert_eq!(t.read_safetensors(&path, &["", "m"]).unwrap(), [buf, moment]);
    }

    /// A safetensors file of `tensors` (name, dtype, shape), zero-filled.
    fn file_of(tensors: &[(&str, Dtype, &[usize])]) -> Vec<u8> {
        let raw: Vec<Vec<u8>> =
            tensors.iter().map(|(_, d, s)| vec![0; d.bitsize() / 8 * s.iter().product::<usize>()]).collect();
        let views =
            tensors.iter().zip(&raw).map(|((n, d, s), r)| (n.to_string(), TensorView::new(*d, s.to_vec(), r).unwrap()));
        safetensors::serialize(views, None).unwrap()
    }

    #[test]
    fn safetensors_that_do_not_fit_are_errors_naming_file_tensor_and_fix() {
        let (t, _) = two();
        let path = Path::new("dir/w.safetensors");
        let load = |tensors: &[(&str, Dtype, &[usize])]| {
            let e = t.from_safetensors(path, &file_of(tensors), &[""]).unwrap_err();
            assert!(matches!(&e, Error::Checkpoint { path: p, .. } if p == path), "{e:?}");
            e.to_string()
        };
        let f32 = Dtype::F32;
        let e = load(&[("a.weight", f32, &[2, 3])]);
        assert!(e.contains("no tensor `a.bias`") && e.contains("F32 [3]") && e.contains("another model"), "{e}");
        let e = load(&[("a.weight", f32, &[3, 2]), ("a.bias", f32, &[3])]);
        assert!(e.contains("`a.weight` has shape [3, 2], the model needs [2, 3]"), "{e}");
        let e = load(&[("a.weight", Dtype::F64, &[2, 3]), ("a.bias", f32, &[3])]);
        assert!(e.contains("`a.weight` is F64") && e.contains("float32"), "{e}");
        let e = load(&[("a.weight", f32, &[2, 3]), ("a.bias", f32, &[3]), ("b.bias", f32, &[1]), ("c", f32, &[1])]);
        assert!(e.contains("holds tensor `b.bias` (and 1 more), which the model does not have"), "{e}");
        let e = t.from_safetensors(path, b"not safetensors", &[""]).unwrap_err().to_string();
        assert!(e.contains("dir/w.safetensors") && e.contains("not a valid safetensors file"), "{e}");
        let missing = scratch("missing").join("none.safetensors");
        let e = t.read_safetensors(&missing, &[""]).unwrap_err().to_string();
        assert!(e.contains("none.safetensors"), "{e}");
    }
}
