//! Your own model, trained by lbbsp's `Run`: data-parallel under MPI, balanced by LB-BSP,
//! checkpointed, resumed bit for bit and written as safetensors under its own parameter names.
//!
//!     cargo build --release --example custom_model
//!     mpirun -n 2 target/release/examples/custom_model --data-dir DIR --out OUT   # or alone: one rank
//!
//! The model, a two-layer perceptron `x → tanh(x·W₁ᵀ + b₁)·W₂ᵀ + b₂` written with ndarray, is
//! defined here, outside the crate: it implements `lbbsp::nn::Trainable` (its parameter table, the
//! flat buffers, the input buffers and a forward/backward pass) and `Run::with_model` does the
//! rest with the digits-mlp recipe's data, optimizer and training settings, `balance.policy =
//! lbbsp`.
//!
//! It trains 2N iterations, checkpointing after N, then resumes a second run, from a model of
//! other initial weights, from that checkpoint to 2N, and checks that both end with the same
//! parameters and losses, bit for bit: it prints OK, or FAILED and exits nonzero. LB-BSP sizes each
//! rank's slice from measured times and a sum's rounding depends on how it is split, so the resumed
//! run replays the first one's splits (`balance.replay`). It writes the final parameters to
//! `OUT/custom_model.safetensors` (`hidden.weight`, `hidden.bias`, `out.weight`, `out.bias`). The
//! data sets are in `--data-dir`, else `LBBSP_DATA`, else `data`; `OUT` (default: a folder in the
//! temporary directory) must be shared by the ranks.

use anyhow::{bail, Context};
use lbbsp::data::rng::Rng;
use lbbsp::dist::comm::Communicator;
use lbbsp::nn::layers::Mode;
use lbbsp::nn::loss::{Loss, LossStats};
use lbbsp::nn::params::ParamTable;
use lbbsp::nn::Trainable;
use lbbsp::train::metrics::{IterRecord, JsonlWriter};
use lbbsp::train::{Resume, Run, RunOptions};
use lbbsp::Mpi;
use ndarray::linalg::general_mat_mul;
use ndarray::{s, Array2, ArrayView, ArrayView2, ArrayViewMut, ArrayViewMutD, Axis, Dimension, Ix1, Ix2};
use std::path::PathBuf;

/// `x → tanh(x·W₁ᵀ + b₁)·W₂ᵀ + b₂` with softmax cross-entropy, over one flat parameter buffer.
struct Mlp {
    table: ParamTable,
    params: Vec<f32>,
    grads: Vec<f32>,
    sample_shape: Vec<usize>,
    classes: usize,
    /// The batch: `capacity × inputs` input rows, labels, sample ids.
    x: Vec<f32>,
    labels: Vec<u32>,
    ids: Vec<usize>,
    /// The hidden activations and the logits of the last forward pass, and `scale · ∂ℓ/∂logits`.
    h: Array2<f32>,
    z: Array2<f32>,
    dz: Array2<f32>,
}

/// Tensor `name` of `buf` (laid out by `table`) in its shape, as a matrix or a vector.
fn tensor<'a, D: Dimension>(table: &ParamTable, buf: &'a [f32], name: &str) -> ArrayView<'a, f32, D> {
    table.view(buf, name).unwrap().into_dimensionality().unwrap()
}
fn tensor_mut<'a, D: Dimension>(table: &ParamTable, buf: &'a mut [f32], name: &str) -> ArrayViewMut<'a, f32, D> {
    table.view_mut(buf, name).unwrap().into_dimensionality().unwrap()
}

/// The first `b` rows of `d` values of `buf`.
fn rows(buf: &[f32], b: usize, d: usize) -> ArrayView2<'_, f32> {
    ArrayView2::from_shape((b, d), &buf[..b * d]).unwrap()
}

impl Mlp {
    fn new(sample_shape: &[usize], hidden: usize, classes: usize, seed: u64) -> Mlp {
        let inputs = sample_shape.iter().product();
        let mut table = ParamTable::default();
        table.push("hidden.weight", &[hidden, inputs]);
        table.push("hidden.bias", &[hidden]);
        table.push("out.weight", &[classes, hidden]);
        table.push("out.bias", &[classes]);
        let mut params = vec![0.0; table.len()];
        // Uniform in ±1/√fan_in, as PyTorch's Linear.
        let mut rng = Rng::from_keys(&[seed]);
        for (name, mut p) in table.views_mut(&mut params) {
            let fan_in = if name.starts_with("hidden.") { inputs } else { hidden };
            p.mapv_inplace(|_| rng.uniform(1.0 / (fan_in as f32).sqrt()));
        }
        Mlp {
            grads: vec![0.0; table.len()],
            table,
            params,
            sample_shape: sample_shape.to_vec(),
            classes,
            x: Vec::new(),
            labels: Vec::new(),
            ids: Vec::new(),
            h: Array2::zeros((0, hidden)),
            z: Array2::zeros((0, classes)),
            dz: Array2::zeros((0, classes)),
        }
    }

    fn inputs(&self) -> usize {
        self.sample_shape.iter().product()
    }

    /// `h = tanh(x·W₁ᵀ + b₁)`, `z = h·W₂ᵀ + b₂` on the first `b` rows.
    fn forward_rows(&mut self, b: usize) {
        let (t, p, x) = (&self.table, &self.params[..], rows(&self.x, b, self.inputs()));
        let mut h = self.h.slice_mut(s![..b, ..]);
        general_mat_mul(1.0, &x, &tensor::<Ix2>(t, p, "hidden.weight").t(), 0.0, &mut h);
        h += &tensor::<Ix1>(t, p, "hidden.bias");
        h.mapv_inplace(f32::tanh);
        let mut z = self.z.slice_mut(s![..b, ..]);
        general_mat_mul(1.0, &h, &tensor::<Ix2>(t, p, "out.weight").t(), 0.0, &mut z);
        z += &tensor::<Ix1>(t, p, "out.bias");
    }
}

impl Trainable for Mlp {
    fn table(&self) -> &ParamTable {
        &self.table
    }
    fn params(&self) -> &[f32] {
        &self.params
    }
    fn grads(&self) -> &[f32] {
        &self.grads
    }
    fn buffers_mut(&mut self) -> (&ParamTable, &mut Vec<f32>, &mut Vec<f32>) {
        (&self.table, &mut self.params, &mut self.grads)
    }
    fn sample_shape(&self) -> &[usize] {
        &self.sample_shape
    }
    fn classes(&self) -> usize {
        self.classes
    }
    fn capacity(&self) -> usize {
        self.labels.len()
    }
    fn set_capacity(&mut self, cap: usize) {
        if cap > self.capacity() {
            self.x = vec![0.0; cap * self.inputs()];
            (self.labels, self.ids) = (vec![0; cap], vec![0; cap]);
            self.h = Array2::zeros((cap, self.h.ncols()));
            (self.z, self.dz) = (Array2::zeros((cap, self.classes)), Array2::zeros((cap, self.classes)));
        }
    }
    fn input_mut(&mut self, b: usize) -> (ArrayViewMutD<'_, f32>, &mut [u32], &mut [usize]) {
        let shape = [&[b], &self.sample_shape[..]].concat();
        let x = ArrayViewMutD::from_shape(shape, &mut self.x[..b * self.sample_shape.iter().product::<usize>()]);
        (x.unwrap(), &mut self.labels[..b], &mut self.ids[..b])
    }
    fn forward(&mut self, b: usize, _mode: Mode) -> LossStats {
        self.forward_rows(b);
        Loss::SoftmaxCrossEntropy.evaluate(self.z.slice(s![..b, ..]), &self.labels[..b], 1.0, None)
    }
    fn forward_backward(&mut self, b: usize, scale: f32, _mode: Mode) -> LossStats {
        if b == 0 {
            self.grads.fill(0.0);
            return LossStats::default();
        }
        self.forward_rows(b);
        let (h, z, mut dz) = (self.h.slice(s![..b, ..]), self.z.slice(s![..b, ..]), self.dz.slice_mut(s![..b, ..]));
        let stats = Loss::SoftmaxCrossEntropy.evaluate(z, &self.labels[..b], scale, Some(dz.view_mut()));
        let (t, p, g) = (&self.table, &self.params[..], &mut self.grads[..]);
        // z = h·W₂ᵀ + b₂: ∂W₂ = dzᵀ·h, ∂b₂ = Σ_rows dz, ∂h = dz·W₂.
        general_mat_mul(1.0, &dz.t(), &h, 0.0, &mut tensor_mut::<Ix2>(t, g, "out.weight"));
        tensor_mut::<Ix1>(t, g, "out.bias").assign(&dz.sum_axis(Axis(0)));
        let mut dh = dz.dot(&tensor::<Ix2>(t, p, "out.weight"));
        // h = tanh(a): ∂a = ∂h · (1 − h²); then the same with x in place of h.
        dh.zip_mut_with(&h, |d, &h| *d *= 1.0 - h * h);
        let x = rows(&self.x, b, self.sample_shape.iter().product());
        general_mat_mul(1.0, &dh.t(), &x, 0.0, &mut tensor_mut::<Ix2>(t, g, "hidden.weight"));
        tensor_mut::<Ix1>(t, g, "hidden.bias").assign(&dh.sum_axis(Axis(0)));
        stats
    }
    fn logits(&self, b: usize) -> ArrayView2<'_, f32> {
        self.z.slice(s![..b, ..])
    }
}

/// Steps `run` until `stop` iterations are done, collecting their records.
fn train_until<M: Trainable>(run: &mut Run<'_, M>, stop: usize, records: &mut Vec<IterRecord>) -> lbbsp::Result<()> {
    loop {
        let plan = run.epoch_plan();
        for t in run.progress().batch_in_epoch..plan.iterations() {
            if run.progress().step == stop {
                return Ok(());
            }
            records.push(run.step(plan.batch(t))?);
        }
        run.end_epoch();
    }
}

fn main() -> anyhow::Result<()> {
    let comm = Mpi::init()?;
    let rank = comm.rank();
    let (mut data_dir, mut out) = (
        PathBuf::from(std::env::var_os("LBBSP_DATA").unwrap_or("data".into())),
        std::env::temp_dir().join("lbbsp-custom-model"),
    );
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next()) {
            ("--data-dir", Some(v)) => data_dir = v.into(),
            ("--out", Some(v)) => out = v.into(),
            _ => bail!("usage: custom_model [--data-dir DIR] [--out DIR]"),
        }
    }
    // Rank 1 made three times slower (when there is one), so that LB-BSP moves work off it.
    let mut sets = vec!["balance.policy=\"lbbsp\"".to_string()];
    if comm.world_size() > 1 {
        sets.push("runtime.slowdown=[\"1:3\"]".into());
    }
    let recipe = lbbsp::train::recipe::resolve("digits-mlp", &sets)?;
    let data = lbbsp::data::load::load(&recipe.data, &data_dir)?;
    let (set, n) = (&data.train, 30);
    let (checkpoints, splits) = (out.join("checkpoints"), out.join("splits.jsonl"));
    if rank == 0 {
        // A fresh run refuses a folder that holds checkpoints: these are the last invocation's.
        let _ = std::fs::remove_dir_all(&checkpoints);
        std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    }
    comm.barrier();

    // The whole run: 2N iterations, a checkpoint after N.
    let opts = RunOptions { checkpoint_dir: Some(checkpoints.clone()), ..Default::default() };
    let mut whole = Run::with_model(Mlp::new(&set.sample_shape, 32, set.classes, 1), &recipe, &data, &comm, &opts)?;
    let mut records = Vec::new();
    train_until(&mut whole, n, &mut records)?;
    whole.save(&checkpoints, None)?;
    train_until(&mut whole, 2 * n, &mut records)?;
    if rank == 0 {
        let mut w = JsonlWriter::create(&splits)?;
        records.iter().try_for_each(|r| w.write(r))?;
        w.flush()?;
        println!(
            "trained {} iterations to loss {:.4}, splits {:?} … {:?}",
            2 * n,
            records[2 * n - 1].loss,
            records[0].batch_sizes,
            records[2 * n - 1].batch_sizes
        );
    }
    comm.barrier();

    // Resumed from the checkpoint after N into a model of other initial weights, on the same splits
    // (so its balancer, of other settings, says it restarts from the equal split: the replay rules).
    let mut replayed = recipe.clone();
    replayed.balance.replay = Some(splits);
    let opts = RunOptions { resume: Resume::From(checkpoints.join(format!("step-{n}"))), ..Default::default() };
    let mut resumed = Run::with_model(Mlp::new(&set.sample_shape, 32, set.classes, 2), &replayed, &data, &comm, &opts)?;
    let mut again = Vec::new();
    train_until(&mut resumed, 2 * n, &mut again)?;

    let bits = |p: &[f32]| p.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let losses = |r: &[IterRecord]| r.iter().map(|r| r.loss.to_bits()).collect::<Vec<_>>();
    let same_params = bits(resumed.model().params()) == bits(whole.model().params());
    let same_losses = losses(&again) == losses(&records[n..]);
    let weights = out.join("custom_model.safetensors");
    if rank == 0 {
        resumed.model().save_safetensors(&weights)?;
        for (name, p) in resumed.model().params_named() {
            println!("{name} {:?}", p.shape());
        }
    }
    comm.barrier();
    if !(same_params && same_losses) {
        bail!(
            "FAILED: resumed from step-{n}, the run does not reach iteration {} bit for bit (same parameters: \
             {same_params}, same losses: {same_losses})",
            2 * n
        );
    }
    if rank == 0 {
        println!(
            "OK: resumed from step-{n}, the run reaches iteration {} bit for bit; wrote {}",
            2 * n,
            weights.display()
        );
    }
    Ok(())
}
