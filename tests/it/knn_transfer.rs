//! kNN label transfer against scArches' weighted_knn_transfer on sklearn neighbours, and the
//! scores against scikit-learn (fixture from `scripts/knn_transfer_reference.py`).

use scfoundry::nn::knn_transfer::{accuracy, confusion_matrix, knn, macro_f1, transfer};
use serde_json::Value;

use crate::common::repo;

fn fixture() -> Value {
    let path = repo().join("tests/fixtures/knn_transfer/reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn matches_scarches_vote_and_sklearn_scores() {
    let f = fixture();
    let (d, nl) = (f["d"].as_u64().unwrap() as usize, f["n_labels"].as_u64().unwrap() as usize);
    let (nr, nq) = (f["n_ref"].as_u64().unwrap() as usize, f["n_query"].as_u64().unwrap() as usize);
    let (r, q) = (f32s(&f["ref"]), f32s(&f["query"]));
    let (rl, truth) = (u32s(&f["ref_labels"]), u32s(&f["truth"]));
    for case in f["cases"].as_array().unwrap() {
        let k = case["k"].as_u64().unwrap() as usize;
        // neighbours and distances of the first 20 query cells, as sklearn's brute force
        let (idx, dist) = knn(&r, nr, &q, nq, d, k);
        for (i, row) in case["neighbors"].as_array().unwrap().iter().enumerate() {
            assert_eq!(&idx[i * k..(i + 1) * k], &u32s(row)[..], "k={k} cell {i} neighbours");
            let dd = f32s(&case["distances"][i]);
            for (a, b) in dist[i * k..(i + 1) * k].iter().zip(&dd) {
                assert!((a - b).abs() <= 1e-5 * b.max(1.0), "k={k} cell {i}: distance {a} vs {b}");
            }
        }
        let t = transfer(&r, nr, &q, nq, d, &rl, nl, k);
        assert_eq!(t.predicted, u32s(&case["predicted"]), "k={k}: predictions");
        let conf = f32s(&case["confidence"]);
        let worst = t.confidence.iter().zip(&conf).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst <= 1e-5, "k={k}: confidence differs by {worst}");
        let acc = accuracy(&truth, &t.predicted);
        let f1 = macro_f1(&truth, &t.predicted);
        assert!((acc - case["accuracy"].as_f64().unwrap()).abs() < 1e-12, "k={k}: accuracy {acc}");
        assert!((f1 - case["macro_f1"].as_f64().unwrap()).abs() < 1e-12, "k={k}: macro-F1 {f1}");
        let cm: Vec<u64> = case["confusion"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        assert_eq!(confusion_matrix(&truth, &t.predicted, nl), cm, "k={k}: confusion matrix");
        eprintln!("k={k}: accuracy {acc:.4}, macro-F1 {f1:.4}, max |confidence - scArches| {worst:.1e}");
    }
}

#[test]
fn scores_with_missing_labels_match_sklearn() {
    let f = fixture();
    let s = &f["scores"];
    let (t, p) = (u32s(&s["truth"]), u32s(&s["predicted"]));
    let nl = s["n_labels"].as_u64().unwrap() as usize;
    assert!((accuracy(&t, &p) - s["accuracy"].as_f64().unwrap()).abs() < 1e-12);
    assert!((macro_f1(&t, &p) - s["macro_f1"].as_f64().unwrap()).abs() < 1e-12, "{} vs {}", macro_f1(&t, &p), s["macro_f1"]);
    let cm: Vec<u64> = s["confusion"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
    assert_eq!(confusion_matrix(&t, &p, nl), cm);
}

#[test]
fn blocked_knn_equals_brute_force_on_many_rows() {
    // more query rows than one block (256) and reference rows than one block (2048)
    let (nr, nq, d, k) = (2500usize, 300usize, 5usize, 7usize);
    let mut s = 1u64;
    let mut next = || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    };
    let r: Vec<f32> = (0..nr * d).map(|_| next()).collect();
    let q: Vec<f32> = (0..nq * d).map(|_| next()).collect();
    let (idx, _) = knn(&r, nr, &q, nq, d, k);
    for i in (0..nq).step_by(37) {
        let mut all: Vec<(f64, u32)> =
            (0..nr).map(|j| ((0..d).map(|t| ((q[i * d + t] - r[j * d + t]) as f64).powi(2)).sum(), j as u32)).collect();
        all.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let want: Vec<u32> = all[..k].iter().map(|p| p.1).collect();
        assert_eq!(&idx[i * k..(i + 1) * k], &want[..], "query {i}");
    }
}
