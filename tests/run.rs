//! `Run` as a library type: a caller's loop of `Run::step` and `Run::end_epoch` is a whole run,
//! `train`'s to the bit, and a checkpoint written between two steps resumes it bit for bit, with
//! nothing but the batches passed in.

mod common;

use common::images;
use lbbsp::data::dataset::{Dataset, Splits};
use lbbsp::dist::comm::Solo;
use lbbsp::train::recipe::{resolve, Recipe};
use lbbsp::train::{Resume, Run, RunOptions};
use lbbsp::Policy;

/// Two epochs of 10 batches of digits-mlp on random images, evaluated after each.
fn setup() -> (Recipe, Splits) {
    let sets = ["train.epochs=2", "train.eval_every_epochs=1"].map(String::from);
    let recipe = resolve("digits-mlp", &sets).unwrap();
    let b = recipe.train.global_batch;
    // Flat, as the MLP takes them.
    let flat = |mut d: Dataset| {
        d.sample_shape = vec![d.sample_shape.iter().product()];
        d
    };
    let data = Splits { train: flat(images(10 * b - b / 2)), test: flat(images(100)) };
    (recipe, data)
}

/// Steps `run` through its epochs as a user's loop would, stopping early after `stop` iterations.
fn drive(run: &mut Run, epochs: usize, stop: usize) {
    while run.progress().epoch < epochs {
        let plan = run.epoch_plan();
        for t in run.progress().batch_in_epoch..plan.iterations() {
            if run.progress().step == stop {
                return;
            }
            let rec = run.step(plan.batch(t)).unwrap();
            assert_eq!(rec.iter + 1, run.progress().step, "the step moved the progress past it");
        }
        run.end_epoch();
    }
}

#[test]
fn a_loop_of_steps_is_trains_run_and_resumes_bit_for_bit() {
    common::tier();
    let (recipe, data) = setup();
    let epochs = recipe.train.epochs;
    let summary = lbbsp::train(&recipe, &data, &Solo, &RunOptions::default()).unwrap();

    let mut whole = Run::new(&recipe, &data, &Solo, &RunOptions::default()).unwrap();
    let per_epoch = whole.epoch_plan().iterations();
    assert_eq!(per_epoch, 10, "the last batch of an epoch is a short one");
    drive(&mut whole, epochs, usize::MAX);
    let p = whole.progress();
    assert_eq!((p.step, p.epoch, p.batch_in_epoch), (summary.iterations, epochs, 0));
    assert_eq!(p.evals, summary.evals, "the same evaluations, bit for bit, as train's");
    let last_epoch_loss = p.epoch_loss.0 / p.epoch_loss.1 as f64;
    assert_eq!(last_epoch_loss.to_bits(), summary.last_epoch_loss.to_bits());

    // Stopped in the second epoch, saved, and continued by a new Run from the checkpoint.
    let dir = common::scratch("run-library");
    let stop = per_epoch + 3;
    let opts = RunOptions { checkpoint_dir: Some(dir.clone()), ..Default::default() };
    let mut first = Run::new(&recipe, &data, &Solo, &opts).unwrap();
    drive(&mut first, epochs, stop);
    first.save(&dir, None).unwrap();
    let saved = first.progress().clone();
    assert_eq!((saved.step, saved.epoch, saved.batch_in_epoch), (stop, 1, 3));
    drop(first);
    let opts = RunOptions { resume: Resume::From(dir), ..Default::default() };
    let mut resumed = Run::new(&recipe, &data, &Solo, &opts).unwrap();
    assert_eq!(resumed.progress(), &saved, "the checkpoint holds the progress the steps made");
    drive(&mut resumed, epochs, usize::MAX);
    assert_eq!(resumed.progress(), whole.progress(), "resumed, the run ends where the whole one did");
    assert_eq!(resumed.balancer().sizes(), whole.balancer().sizes());
}

#[test]
fn a_batch_that_is_not_the_plans_is_an_error() {
    common::tier();
    let (recipe, data) = setup();
    let mut run = Run::new(&recipe, &data, &Solo, &RunOptions::default()).unwrap();
    let (b, n) = (recipe.train.global_batch, data.train.len());
    let (too_many, past_the_end) = (vec![0; b + 1], [0, n]);
    let cases = [
        (&too_many[..], format!("has {} samples", b + 1)),
        (&[][..], "has 0 samples".to_string()),
        (&past_the_end[..], format!("names sample {n}")),
    ];
    for (batch, names) in cases {
        let err = run.step(batch).unwrap_err().to_string();
        assert!(err.contains(&names) && err.contains("Run::epoch_plan"), "{err}");
    }
    assert_eq!(run.progress(), &lbbsp::Progress::default(), "a refused batch leaves the progress alone");
    let plan = run.epoch_plan();
    run.step(plan.batch(0)).unwrap();
    assert_eq!(run.progress().step, 1);
}
