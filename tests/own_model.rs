//! A model defined outside the crate trains through `Run::with_model`: it steps, checkpoints under
//! its own parameter names and resumes bit for bit; a model that does not fit the run is refused
//! with an `Error::ModelMismatch` naming what differs.

mod common;

use common::images;
use lbbsp::data::dataset::{Dataset, Splits};
use lbbsp::dist::comm::Solo;
use lbbsp::nn::layers::Mode;
use lbbsp::nn::loss::{Loss, LossStats};
use lbbsp::nn::params::ParamTable;
use lbbsp::nn::Trainable;
use lbbsp::train::recipe::{resolve, Recipe};
use lbbsp::train::{Resume, Run, RunOptions};
use lbbsp::Error;
use ndarray::{s, Array2, ArrayView2, ArrayViewMutD, Axis, Ix1, Ix2};

/// Softmax regression, `z = x·Wᵀ + b`, with parameters `scores.weight` and `scores.bias`.
struct Softmax {
    table: ParamTable,
    params: Vec<f32>,
    grads: Vec<f32>,
    sample_shape: Vec<usize>,
    classes: usize,
    x: Vec<f32>,
    labels: Vec<u32>,
    ids: Vec<usize>,
    z: Array2<f32>,
    /// A capacity the model keeps whatever it is asked for, when set.
    fixed: Option<usize>,
}

impl Softmax {
    fn new(sample_shape: &[usize], classes: usize, value: f32) -> Softmax {
        let mut table = ParamTable::default();
        table.push("scores.weight", &[classes, sample_shape.iter().product()]);
        table.push("scores.bias", &[classes]);
        let params = (0..table.len()).map(|i| value * ((i % 7) as f32 - 3.0)).collect();
        Softmax {
            grads: vec![0.0; table.len()],
            table,
            params,
            sample_shape: sample_shape.to_vec(),
            classes,
            x: Vec::new(),
            labels: Vec::new(),
            ids: Vec::new(),
            z: Array2::zeros((0, classes)),
            fixed: None,
        }
    }

    fn inputs(&self) -> usize {
        self.sample_shape.iter().product()
    }

    fn x(&self, b: usize) -> ArrayView2<'_, f32> {
        ArrayView2::from_shape((b, self.inputs()), &self.x[..b * self.inputs()]).unwrap()
    }

    fn forward_rows(&mut self, b: usize) {
        let w = self.param("scores.weight").unwrap().into_dimensionality::<Ix2>().unwrap();
        let bias = self.param("scores.bias").unwrap().into_dimensionality::<Ix1>().unwrap();
        let z = self.x(b).dot(&w.t()) + bias;
        self.z.slice_mut(s![..b, ..]).assign(&z);
    }
}

impl Trainable for Softmax {
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
        let cap = self.fixed.unwrap_or(cap);
        if cap > self.capacity() {
            self.x = vec![0.0; cap * self.inputs()];
            (self.labels, self.ids, self.z) = (vec![0; cap], vec![0; cap], Array2::zeros((cap, self.classes)));
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
        self.forward_rows(b);
        let mut dz = Array2::zeros((b, self.classes));
        let stats = Loss::SoftmaxCrossEntropy.evaluate(
            self.z.slice(s![..b, ..]),
            &self.labels[..b],
            scale,
            Some(dz.view_mut()),
        );
        let gw = dz.t().dot(&self.x(b));
        let (table, _, grads) = self.buffers_mut();
        table.view_mut(grads, "scores.weight").unwrap().assign(&gw.into_dyn());
        table.view_mut(grads, "scores.bias").unwrap().assign(&dz.sum_axis(Axis(0)).into_dyn());
        stats
    }
    fn logits(&self, b: usize) -> ArrayView2<'_, f32> {
        self.z.slice(s![..b, ..])
    }
}

/// digits-mlp's optimizer and schedule on 10 batches of random images a epoch, two epochs.
fn setup() -> (Recipe, Splits) {
    let sets = ["train.epochs=2", "train.eval_every_epochs=1"].map(String::from);
    let recipe = resolve("digits-mlp", &sets).unwrap();
    let b = recipe.train.global_batch;
    (recipe, Splits { train: images(10 * b), test: images(100) })
}

fn model(data: &Dataset, value: f32) -> Softmax {
    Softmax::new(&data.sample_shape, data.classes, value)
}

/// Steps `run` until `stop` iterations are done.
fn train_until(run: &mut Run<'_, Softmax>, stop: usize) {
    while run.progress().step < stop {
        let plan = run.epoch_plan();
        for t in run.progress().batch_in_epoch..plan.iterations() {
            if run.progress().step == stop {
                return;
            }
            run.step(plan.batch(t)).unwrap();
        }
        run.end_epoch();
    }
}

#[test]
fn a_model_of_ones_own_trains_checkpoints_by_its_names_and_resumes_bit_for_bit() {
    common::tier();
    let (recipe, data) = setup();
    let dir = common::scratch("own-model");
    let opts = RunOptions { checkpoint_dir: Some(dir.clone()), ..Default::default() };
    let mut whole = Run::with_model(model(&data.train, 0.01), &recipe, &data, &Solo, &opts).unwrap();
    let first = whole.step(whole.epoch_plan().batch(0)).unwrap().loss;
    train_until(&mut whole, 13);
    whole.save(&dir, None).unwrap();
    train_until(&mut whole, 16);
    let last = whole.progress().epoch_loss;
    assert!(last.0 / (last.1 as f64) < first, "it learns: loss {first} at first, {last:?} (sum, n) in epoch 2");
    assert!(whole.model().grad("scores.bias").unwrap().iter().any(|&g| g != 0.0));

    // The checkpoint holds the model's tensors under its own names.
    let names: Vec<(String, Vec<usize>)> =
        whole.model().table().entries().iter().map(|e| (e.name.clone(), e.shape.clone())).collect();
    assert_eq!(names, [("scores.weight".to_string(), vec![10, 784]), ("scores.bias".to_string(), vec![10])]);
    let saved = lbbsp::train::checkpoint::read_weights(&dir.join("step-13"), whole.model().table()).unwrap();
    let mut loaded = model(&data.train, 0.0);
    loaded.load_safetensors(&dir.join("step-13").join("model.safetensors")).unwrap();
    assert_eq!(loaded.params, saved);

    // Resumed into a model of other weights, it ends where the whole run did.
    let opts = RunOptions { resume: Resume::From(dir.join("step-13")), ..Default::default() };
    let mut resumed = Run::with_model(model(&data.train, 0.5), &recipe, &data, &Solo, &opts).unwrap();
    assert_eq!(resumed.progress().step, 13);
    train_until(&mut resumed, 16);
    let bits = |p: &[f32]| p.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(resumed.model().params()), bits(whole.model().params()), "resumed bit for bit");
    assert_eq!(resumed.progress(), whole.progress());
}

#[test]
fn a_model_that_does_not_fit_the_run_is_refused_by_what_differs() {
    common::tier();
    let (recipe, data) = setup();
    let refusal = |m: Softmax| match Run::with_model(m, &recipe, &data, &Solo, &RunOptions::default()) {
        Err(e @ Error::ModelMismatch { .. }) => e,
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("accepted"),
    };
    let e = refusal(Softmax::new(&[28, 27], 10, 0.0));
    assert!(matches!(e, Error::ModelMismatch { what: "input size", .. }), "{e}");
    assert!(e.to_string().contains("756 values per sample") && e.to_string().contains("784"), "{e}");
    let e = refusal(Softmax::new(&[784], 9, 0.0));
    assert!(matches!(e, Error::ModelMismatch { what: "class count", .. }), "{e}");
    assert!(e.to_string().contains("is 9") && e.to_string().contains("10 classes"), "{e}");
    let mut small = Softmax::new(&[784], 10, 0.0);
    small.fixed = Some(8);
    let e = refusal(small);
    assert!(matches!(e, Error::ModelMismatch { what: "capacity", .. }), "{e}");
    assert!(e.to_string().contains("8 samples") && e.to_string().contains("up to 64"), "{e}");
    // A flat model on image samples of as many values fits.
    Run::with_model(Softmax::new(&[784], 10, 0.0), &recipe, &data, &Solo, &RunOptions::default()).unwrap();
}
