//! The bytes a run must hold, measured by [`lbbsp::train::footprint::Footprint`] from the
//! process's heap statistics. A test binary of its own: glibc's `mallinfo2` is process-wide, so a
//! neighbouring test freeing its thread's buffers mid-measurement would skew it.

mod common;

use common::images;
use lbbsp::data::dataset::Splits;

/// [`lbbsp::train::footprint::Footprint`] counts the data set, parameters, two gradients, the momentum buffer
/// and the model's activation buffers at its batch capacity (256 rows for W1).
#[test]
fn footprint_of_w1_counts_every_part() {
    let recipe = lbbsp::train::recipe::resolve("bench-w1", &[]).unwrap();
    let data = Splits { train: images(2), test: images(1) };
    let f = lbbsp::train::footprint::Footprint::measure(&recipe, &data, 1).unwrap();
    let n = (784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10) as u64;
    assert_eq!((f.dataset, f.params, f.grads, f.optimizer), (3 * 785 * 4, 4 * n, 8 * n, 4 * n));
    // Input rows, the outputs of the 5 layers above the flatten (which reuses its input's buffer)
    // and the gradients of the 4 below the last, 256 rows each: a lower bound; layer caches and
    // small buffers come on top.
    let floats = 784 + (512 + 512 + 256 + 256 + 10) + (512 + 512 + 256 + 256);
    let least = 256 * 4 * floats as u64;
    assert!(f.activations >= least && f.activations < least * 3 / 2, "{f:?}, at least {least}");
    assert_eq!(f.total(), f.dataset + f.params + f.grads + f.optimizer + f.activations);
}
