//! GPU presets for `paro plan`: what one GPU of a class computes and moves, so that a cluster is named by its GPU,
//! its nodes and its network instead of by every figure.
//!
//! Compute is the dense bf16 peak times a stated efficiency (the model FLOPs utilisation large-model training
//! reaches; 0.5 unless given). The optimizer step is memory-bound: an AdamW update reads and writes about 32 bytes
//! per parameter (fp32 master, two moments, the gradient, the bf16 copy), at the memory bandwidth. Intra-group
//! bandwidth is what a ring collective achieves per GPU over NVLink (the bus bandwidth nccl-tests reports
//! for all-gather on one node); inter-group bandwidth is one NIC per GPU (a
//! rail), given in Gbit/s.

use serde::Serialize;

use super::request::{Cluster, Link};
use crate::error::{ParoError, Result};

/// One GPU class.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GpuPreset {
    /// Its name: a100, h100, h800.
    pub name: &'static str,
    /// Dense bf16 peak, FLOP/s.
    pub peak_flops: f64,
    /// Memory, bytes.
    pub memory_bytes: u64,
    /// Memory bandwidth, bytes/s.
    pub memory_bandwidth: f64,
    /// Ring-collective bandwidth per GPU over NVLink, bytes/s.
    pub nvlink_bandwidth: f64,
}

/// The presets.
pub const GPU_PRESETS: [GpuPreset; 3] = [
    // A100 SXM 80 GB: 312 TFLOP/s bf16, 2.0 TB/s HBM2e, NVLink 3 (600 GB/s both ways)
    GpuPreset {
        name: "a100",
        peak_flops: 312e12,
        memory_bytes: 80_000_000_000,
        memory_bandwidth: 2.0e12,
        nvlink_bandwidth: 230e9,
    },
    // H100 SXM: 989 TFLOP/s bf16, 3.35 TB/s HBM3, NVLink 4 (900 GB/s both ways)
    GpuPreset {
        name: "h100",
        peak_flops: 989e12,
        memory_bytes: 80_000_000_000,
        memory_bandwidth: 3.35e12,
        nvlink_bandwidth: 360e9,
    },
    // H800: an H100 with NVLink cut to 400 GB/s both ways
    GpuPreset {
        name: "h800",
        peak_flops: 989e12,
        memory_bytes: 80_000_000_000,
        memory_bandwidth: 3.35e12,
        nvlink_bandwidth: 160e9,
    },
];

/// Bytes an AdamW update moves per parameter (reads and writes).
const OPTIMIZER_BYTES_PER_PARAM: f64 = 32.0;
/// Latency of one intra-group (NVLink) and one inter-group (RDMA) ring step, seconds.
const INTRA_LATENCY: f64 = 5e-6;
const INTER_LATENCY: f64 = 20e-6;

impl GpuPreset {
    /// The preset named `name` (case ignored).
    pub fn named(name: &str) -> Result<GpuPreset> {
        let key = name.trim().to_ascii_lowercase();
        GPU_PRESETS.iter().copied().find(|p| p.name == key).ok_or_else(|| {
            let names: Vec<&str> = GPU_PRESETS.iter().map(|p| p.name).collect();
            ParoError::Invalid(format!("unknown GPU preset {name:?}; use one of {}", names.join(", ")))
        })
    }

    /// A cluster of `world` such GPUs in groups (nodes) of `group_size`, `inter_gbit` Gbit/s per GPU between
    /// nodes, computing at `efficiency` of the peak.
    pub fn cluster(&self, world: usize, group_size: usize, inter_gbit: f64, efficiency: f64) -> Result<Cluster> {
        if !(efficiency > 0.0 && efficiency <= 1.0) {
            return Err(ParoError::Invalid(format!("efficiency {efficiency} must be in (0, 1]")));
        }
        if !(inter_gbit.is_finite() && inter_gbit > 0.0) {
            return Err(ParoError::Invalid(format!("inter-node bandwidth {inter_gbit} Gbit/s must be positive")));
        }
        let intra = Link::new(self.nvlink_bandwidth, INTRA_LATENCY);
        let inter = Link::new(inter_gbit * 1e9 / 8.0, INTER_LATENCY);
        // the engine's copy-out after each parameter gather is left out (no unpack bandwidth): unmeasured on GPUs
        // so far (where paro runs, the link probe measures it; benchmarks/JOURNAL.md, "The unshard's copy-out")
        Ok(Cluster {
            compute_flops: Some(self.peak_flops * efficiency),
            optimizer_params_per_s: Some(self.memory_bandwidth / OPTIMIZER_BYTES_PER_PARAM),
            ..Cluster::new(world, group_size, intra, inter, self.memory_bytes)
        })
    }
}
