//! Words and units of the report: caveats, bytes and seconds.

use super::request::Cluster;
use crate::model::Model;

pub(super) fn notes(model: &Model, cluster: &Cluster) -> Vec<String> {
    let mut notes = Vec::new();
    if cluster.compute_flops.is_none() {
        notes.push(
            "no compute throughput (compute_flops): the step time counts communication only, and nothing hides it"
                .to_string(),
        );
    }
    if cluster.optimizer_params_per_s.is_none() {
        notes.push("no optimizer throughput (optimizer_params_per_s): the optimizer step counts as free".to_string());
    }
    if !model.blocks_known {
        notes.push(
            "block sizes are unknown (a bare parameter count): gathered-parameter and unsharded-gradient buffers \
             are not counted and each collective is one call over the whole model; give num_blocks, a shape or \
             blocks"
                .to_string(),
        );
    }
    if model.shape.is_none() {
        notes.push("no model shape: activations are not counted".to_string());
    }
    notes
}

/// Bytes as GB (1e9) with one decimal from 1 GB up, two down to 10 MB, else as MB, or bytes below 1 MB.
pub(super) fn gb(bytes: u64) -> String {
    let x = bytes as f64 / 1e9;
    if x >= 1.0 {
        format!("{x:.1} GB")
    } else if x >= 0.01 {
        format!("{x:.2} GB")
    } else if bytes >= 1_000_000 {
        format!("{:.1} MB", bytes as f64 / 1e6)
    } else {
        format!("{bytes} B")
    }
}

/// Seconds with a unit that keeps three significant digits.
pub(super) fn secs(t: f64) -> String {
    if t >= 1.0 {
        format!("{t:.2} s")
    } else if t >= 1e-3 {
        format!("{:.1} ms", t * 1e3)
    } else {
        format!("{:.1} µs", t * 1e6)
    }
}

/// A percentage without trailing zeros: 1, 0.5, 12.3.
pub(super) fn trim_float(x: f64) -> String {
    let s = format!("{x:.1}");
    s.strip_suffix(".0").map(str::to_string).unwrap_or(s)
}
