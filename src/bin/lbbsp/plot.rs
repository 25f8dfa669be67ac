//! `lbbsp plot`: one SVG of one or more runs' per-iteration metrics (`lbbsp train --metrics`).
//!
//! Three stacked panels share the iteration axis:
//! (a) each rank's batch size, (b) each rank's compute time, (c) each run's iteration time.
//! In (a) and (b) the colour is the rank and the dash the run (first file solid); in (c) the colour
//! is the run. Legends name runs by file stem, so `bsp.jsonl` and `lbbsp.jsonl` read as "bsp" and
//! "lbbsp".

use lbbsp::error::{Error, Result};
use lbbsp::train::metrics::{read_records, IterRecord};
use plotters::prelude::*;
use std::path::{Path, PathBuf};

/// Plot per-iteration metrics of one or more runs to an SVG file.
#[derive(clap::Args, Debug, Clone)]
pub struct PlotArgs {
    /// Metrics files (JSONL) written by `lbbsp train --metrics`; legends name each by its file stem.
    #[arg(required = true, value_name = "METRICS.jsonl")]
    pub files: Vec<PathBuf>,
    /// SVG file to write.
    #[arg(short, long, value_name = "FILE.svg")]
    pub output: PathBuf,
}

/// One run's records and its legend name.
struct Run {
    name: String,
    records: Vec<IterRecord>,
}

/// One line of a panel.
struct Series {
    label: String,
    color: RGBColor,
    /// 0 draws a solid line; `k > 0` the pattern `DASHES[k − 1]` (cycled).
    dash: usize,
    points: Vec<(f64, f64)>,
}

/// One chart: a title, a y-axis description and its lines.
struct Panel {
    title: &'static str,
    y_desc: &'static str,
    /// Decimals of the y tick labels [default: from the axis range].
    y_decimals: Option<usize>,
    series: Vec<Series>,
}

/// Colour-blind-safe palette (Okabe–Ito), cycled.
const PALETTE: [RGBColor; 7] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
];

/// Dash patterns (pixels on, off) of the second, third... file in panels (a) and (b), cycled.
const DASHES: [(i32, i32); 3] = [(8, 5), (2, 4), (16, 6)];

const WIDTH: u32 = 1000;
const PANEL_HEIGHT: u32 = 380;
const TITLE_HEIGHT: u32 = 40;

/// Reads every file in `args.files` and writes the three-panel SVG to `args.output`.
pub fn run(args: &PlotArgs) -> Result<()> {
    let runs = args.files.iter().map(|p| load_run(p, &args.files)).collect::<Result<Vec<_>>>()?;
    draw(&runs, &args.output)
}

/// A file's records; a file without any is an error naming it.
fn load_run(path: &Path, all: &[PathBuf]) -> Result<Run> {
    let records = read_records(path)?;
    if records.is_empty() {
        return Err(Error::data(path, "no iteration records (is it a `lbbsp train --metrics` file?)"));
    }
    let stem = |p: &Path| p.file_stem().map(|s| s.to_string_lossy().into_owned());
    // Stems name runs unless two files share one (`a/metrics.jsonl`, `b/metrics.jsonl`).
    let shared = all.iter().filter(|p| stem(p) == stem(path)).count() > 1;
    let name = match stem(path) {
        Some(s) if !shared => s,
        _ => path.display().to_string(),
    };
    Ok(Run { name, records })
}

/// The three panels' lines.
fn panels(runs: &[Run]) -> [Panel; 3] {
    let per_rank = |value: fn(&IterRecord, usize) -> f64| -> Vec<Series> {
        let mut out = Vec::new();
        for (f, run) in runs.iter().enumerate() {
            let world = run.records.iter().map(|r| r.batch_sizes.len()).max().unwrap_or(0);
            for rank in 0..world {
                let points = run
                    .records
                    .iter()
                    .filter(|r| rank < r.batch_sizes.len() && rank < r.compute_s.len())
                    .map(|r| (r.iter as f64, value(r, rank)))
                    .collect();
                let label = if runs.len() > 1 { format!("{} rank {rank}", run.name) } else { format!("rank {rank}") };
                out.push(Series { label, color: PALETTE[rank % PALETTE.len()], dash: f, points });
            }
        }
        out
    };
    let iter_time = runs
        .iter()
        .enumerate()
        .map(|(f, run)| Series {
            label: run.name.clone(),
            color: PALETTE[f % PALETTE.len()],
            dash: 0,
            points: run.records.iter().map(|r| (r.iter as f64, 1e3 * r.iter_s)).collect(),
        })
        .collect();
    [
        Panel {
            title: "(a) batch size per rank",
            y_desc: "samples",
            y_decimals: Some(0),
            series: per_rank(|r, k| r.batch_sizes[k] as f64),
        },
        Panel {
            title: "(b) compute time per rank",
            y_desc: "compute (ms)",
            y_decimals: None,
            series: per_rank(|r, k| 1e3 * r.compute_s[k]),
        },
        Panel { title: "(c) iteration time", y_desc: "iteration (ms)", y_decimals: None, series: iter_time },
    ]
}

/// Renders the panels of `runs` to an SVG at `out`.
fn draw(runs: &[Run], out: &Path) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| Error::Output { path: out.to_path_buf(), msg: e.to_string() };
    let height = TITLE_HEIGHT + 3 * PANEL_HEIGHT;
    let root = SVGBackend::new(out, (WIDTH, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
    let root =
        root.titled(&format!("lbbsp metrics: {}", names.join(" vs ")), ("sans-serif", 24)).map_err(|e| err(&e))?;
    let x_max = runs.iter().flat_map(|r| r.records.iter().map(|r| r.iter)).max().unwrap_or(0).max(1) as f64;
    for (area, panel) in root.split_evenly((3, 1)).iter().zip(panels(runs)) {
        draw_panel(area, &panel, x_max).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;
type DrawResult<'a> = std::result::Result<(), DrawingAreaErrorKind<<SVGBackend<'a> as DrawingBackend>::ErrorType>>;

/// One panel: axes from 0, lines, and a legend in the upper right corner above the data.
fn draw_panel<'a>(area: &Area<'a>, panel: &Panel, x_max: f64) -> DrawResult<'a> {
    let y_data = panel.series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).fold(0.0, f64::max);
    // Headroom above the data for the legend: one row of 22 px per series in a 300 px plot.
    let rows = panel.series.len() as f64;
    let y_max = (y_data / (1.0 - (rows * 22.0 + 16.0) / 300.0).max(0.4)).max(1e-9);
    let decimals = panel.y_decimals.unwrap_or(match y_max {
        m if m >= 20.0 => 0,
        m if m >= 2.0 => 1,
        _ => 2,
    });
    let mut chart = ChartBuilder::on(area)
        .caption(panel.title, ("sans-serif", 18))
        .margin(8)
        .margin_right(24)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("iteration")
        .y_desc(panel.y_desc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.decimals$}"))
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 15))
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    for s in &panel.series {
        let style = s.color.stroke_width(2);
        // Pixels on and off; a solid line is one long dash.
        let (on, off) = if s.dash == 0 { (24, 0) } else { DASHES[(s.dash - 1) % DASHES.len()] };
        let anno = if s.dash == 0 {
            chart.draw_series(LineSeries::new(s.points.iter().copied(), style))?
        } else {
            let points = s.points.iter().copied();
            chart.draw_series(DashedLineSeries::new(points, on, off, style))?
        };
        anno.label(s.label.as_str()).legend(move |(x, y)| {
            plotters::element::DashedPathElement::new(vec![(x, y), (x + 24, y)], on, off.max(1), style)
        });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.4))
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbbsp::train::metrics::{IterRecord, JsonlWriter};

    fn tmp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("lbbsp-plot-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn write_metrics(path: &Path, records: &[IterRecord]) {
        let mut w = JsonlWriter::create(path).unwrap();
        for r in records {
            w.write(r).unwrap();
        }
        w.flush().unwrap();
    }

    #[test]
    fn plots_two_runs_to_svg() {
        let dir = tmp_dir("ok");
        let (bsp, lb, out) = (dir.join("bsp.jsonl"), dir.join("lb.jsonl"), dir.join("out.svg"));
        write_metrics(
            &bsp,
            &[
                IterRecord::timed(0, vec![32, 32], vec![0.01, 0.03]),
                IterRecord::timed(1, vec![32, 32], vec![0.01, 0.03]),
            ],
        );
        write_metrics(
            &lb,
            &[
                IterRecord::timed(0, vec![32, 32], vec![0.01, 0.03]),
                IterRecord::timed(1, vec![48, 16], vec![0.015, 0.015]),
            ],
        );
        run(&PlotArgs { files: vec![bsp, lb], output: out.clone() }).unwrap();
        let svg = std::fs::read_to_string(&out).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(svg.contains("<svg"), "{svg}");
        for text in ["bsp rank 1", "lb rank 0", "(c) iteration time", "compute (ms)", "bsp vs lb"] {
            assert!(svg.contains(text), "missing {text:?}");
        }
    }

    #[test]
    fn errors_name_the_file() {
        let dir = tmp_dir("err");
        let out = dir.join("out.svg");
        let missing = dir.join("missing.jsonl");
        let e = run(&PlotArgs { files: vec![missing.clone()], output: out.clone() }).unwrap_err();
        assert!(matches!(&e, Error::Io { path, .. } if *path == missing), "{e}");
        assert!(e.to_string().contains("missing.jsonl"), "{e}");

        let (empty, bad) = (dir.join("empty.jsonl"), dir.join("bad.jsonl"));
        std::fs::write(&empty, "\n").unwrap();
        std::fs::write(&bad, "{\"iter\": 0}\n").unwrap();
        for (file, what) in [(&empty, "no iteration records"), (&bad, "line 1")] {
            let e = run(&PlotArgs { files: vec![file.clone()], output: out.clone() }).unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains(&*file.to_string_lossy()) && msg.contains(what), "{msg}");
        }
        let good = dir.join("good.jsonl");
        write_metrics(&good, &[IterRecord::timed(0, vec![8], vec![0.01])]);
        let unwritable = dir.join("no-such-dir").join("out.svg");
        let e = run(&PlotArgs { files: vec![good], output: unwritable }).unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(e.to_string().contains("no-such-dir"), "{e}");
    }

    #[test]
    fn shared_stems_fall_back_to_paths() {
        let dir = tmp_dir("stem");
        let p = dir.join("m.jsonl");
        write_metrics(&p, &[IterRecord::timed(0, vec![8], vec![0.01])]);
        let alone = load_run(&p, std::slice::from_ref(&p)).unwrap().name;
        let shared = load_run(&p, &[p.clone(), PathBuf::from("other/m.jsonl")]).unwrap().name;
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(alone, "m");
        assert_eq!(shared, p.display().to_string());
    }
}
