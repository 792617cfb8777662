//! A non-finite production indexer score is a non-finite onset: the
//! reference engine traced with a NaN planted in one layer's indexer keys.

use shadowtrace_analyzer::{Options, Run, analyze};
use shadowtrace_schemas::Table;
use shadowtrace_tracer::model::fault::Fault;
use shadowtrace_tracer::model::{Model, synthetic};
use shadowtrace_tracer::trace::{TraceOptions, trace};
use tch::Device;

#[test]
fn a_nan_in_the_production_indexer_scores_is_the_onset_and_its_rows_stay_sparse() {
    let tmp = tempfile::tempdir().unwrap();
    let model_dir = tmp.path().join("model");
    let mut config = synthetic::glm51_config(3);
    // 48 tokens over k = 16: queries from token 16 on select among more keys than k.
    config["index_topk"] = 16.into();
    synthetic::write(&model_dir, &config, 7).unwrap();
    let model = Model::open(&model_dir, Device::Cpu).unwrap();
    let mut opts = TraceOptions::new("tiny-glm");
    opts.faults.push(Fault::IndexerKey {
        layer: 1,
        scale: f64::NAN,
    });
    let ids: Vec<i64> = (0..48).map(|i| (i * 37) % 256).collect();
    let run_dir = tmp.path().join("runs").join("indexer-nan");
    tch::no_grad(|| trace(&model, &ids, "indexer-nan", &run_dir, &opts)).unwrap();

    let a = analyze(
        std::slice::from_ref(&run_dir),
        &[],
        &Options::default(),
        |_, _, _| {},
    )
    .unwrap();
    let onset = a.runs[0]
        .onset
        .as_ref()
        .expect("the indexer's NaN is an onset");
    assert_eq!(
        (
            onset.layer,
            onset.site.as_str(),
            onset.token,
            onset.kind.as_str(),
            onset.shadow_finite
        ),
        (1, "indexer", Some(0), "nan", Some(true)),
        "{onset:?}"
    );

    // Sparse rows stay sparse: a NaN k-th score is written as NaN, not as the
    // null of a dense row.
    let frame = Run::open(&run_dir)
        .unwrap()
        .read_table(
            Table::Topk,
            Some(&["layer", "k", "visible", "prod_kth_score"]),
        )
        .unwrap();
    let layer = frame.column("layer").unwrap().i32().unwrap().clone();
    let k = frame.column("k").unwrap().i32().unwrap().clone();
    let visible = frame.column("visible").unwrap().i32().unwrap().clone();
    let kth = frame
        .column("prod_kth_score")
        .unwrap()
        .f32()
        .unwrap()
        .clone();
    let mut sparse = 0;
    for i in 0..frame.height() {
        if layer.get(i) == Some(1) && visible.get(i) > k.get(i) {
            sparse += 1;
            assert!(
                kth.get(i).is_some_and(f32::is_nan),
                "row {i}: {:?}",
                kth.get(i)
            );
        }
    }
    assert_eq!(sparse, 48 - 16);
}
