//! `paro_torch._C`: thin pyo3 bindings of paro-core plus the hand-off to the C++ c10d backend.

mod bridge;

use paro_core::planner::{self, ChunkPolicy, Collective};
use paro_core::strategy::{Granularity, Strategy as CoreStrategy};
use paro_core::{layout, topology, ParoError, Topology};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

pyo3::create_exception!(paro_torch, InvalidStrategyError, PyValueError, "A strategy code or alias that PaRO rejects.");
pyo3::create_exception!(paro_torch, TopologyError, PyValueError, "World size, group size or rank that do not fit.");

/// The torch this extension was compiled against (build.rs), behind a marker: `import paro_torch` finds it in this
/// file's bytes, without loading the file, to refuse another torch minor with a clear message.
const BUILT_WITH_TORCH: &str = concat!("paro-torch-built-with torch==", env!("PARO_TORCH_VERSION"), "\n");

fn to_py(e: ParoError) -> PyErr {
    match e {
        ParoError::UnknownStrategy(..) | ParoError::EliminatedStrategy { .. } => {
            InvalidStrategyError::new_err(e.to_string())
        }
        ParoError::Topology(_) => TopologyError::new_err(e.to_string()),
        _ => PyValueError::new_err(e.to_string()),
    }
}

fn gran(text: &str) -> PyResult<Granularity> {
    let mut chars = text.chars();
    match (chars.next().and_then(Granularity::from_letter), chars.next()) {
        (Some(g), None) => Ok(g),
        _ => Err(PyValueError::new_err(format!("granularity must be one of N, I, G (got {text:?})"))),
    }
}

/// A PaRO-DP strategy: sharding granularity of parameters (p), gradients (g) and optimizer states (os).
#[pyclass(module = "paro_torch._C", name = "Strategy", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
struct PyStrategy(CoreStrategy);

#[pymethods]
impl PyStrategy {
    /// Parses a code ("IIG", "PaRO-IIG") or an alias ("zero3", "hsdp"); raises InvalidStrategyError.
    #[new]
    fn new(code: &str) -> PyResult<Self> {
        CoreStrategy::parse(code).map(PyStrategy).map_err(to_py)
    }

    /// Same as the constructor.
    #[staticmethod]
    fn parse(code: &str) -> PyResult<Self> {
        Self::new(code)
    }

    /// The 14 valid strategies.
    #[staticmethod]
    fn all() -> Vec<Self> {
        CoreStrategy::all_valid().into_iter().map(PyStrategy).collect()
    }

    /// Parameter granularity: "N", "I" or "G".
    #[getter]
    fn p(&self) -> String {
        self.0.p.letter().to_string()
    }

    /// Gradient granularity.
    #[getter]
    fn g(&self) -> String {
        self.0.g.letter().to_string()
    }

    /// Optimizer-state granularity.
    #[getter]
    fn os(&self) -> String {
        self.0.os.letter().to_string()
    }

    /// The three-letter code.
    #[getter]
    fn code(&self) -> String {
        self.0.code()
    }

    /// How many units past the computing one the engine may gather ahead (None: all at the start of a pass);
    /// the cost model's step schedule assumes the same (`paro_core::cost::IssuePolicy`).
    #[getter]
    fn gather_ahead(&self) -> Option<usize> {
        paro_core::cost::IssuePolicy::of(self.0).gather_ahead
    }

    /// The well-known name (ddp, zero1, zero2, zero3, mics, hsdp_zero2), if any.
    #[getter]
    fn known_as(&self) -> Option<&'static str> {
        self.0.known_as()
    }

    fn __repr__(&self) -> String {
        format!("Strategy('{}')", self.0.code())
    }

    fn __str__(&self) -> String {
        self.0.code()
    }
}

/// Raises TopologyError unless `group_size` divides `world`.
#[pyfunction]
fn check_topology(world: usize, group_size: usize) -> PyResult<()> {
    Topology::new(world, group_size).map(|_| ()).map_err(to_py)
}

/// `(world, group_size)` of a process group from its members' global ranks, or None and the reason it runs flat.
#[pyfunction]
fn subgroup_shape(global_ranks: Vec<usize>, group_size: usize) -> PyResult<(Option<(usize, usize)>, Option<String>)> {
    let s = topology::subgroup_shape(&global_ranks, group_size).map_err(to_py)?;
    Ok((s.topology.map(|t| (t.world, t.group_size)), s.flat_reason))
}

/// The per-parameter shard layout of one flat buffer (see paro-core's `layout`): blocks of equal size at
/// one granularity, each parameter's rows split as `torch.chunk` (and DTensor's `Shard(0)`) split them.
#[pyclass(module = "paro_torch._C", name = "RowLayout", frozen)]
struct PyRowLayout(layout::RowLayout);

#[pymethods]
impl PyRowLayout {
    /// `params`: `(rows, row_numel, replicated)` per parameter; `granularity`: "N", "I" or "G".
    #[new]
    fn new(params: Vec<(u64, u64, bool)>, world: usize, group_size: usize, granularity: &str) -> PyResult<Self> {
        let t = Topology::new(world, group_size).map_err(to_py)?;
        let rows: Vec<layout::ParamRows> = params
            .into_iter()
            .map(|(rows, row_numel, replicated)| layout::ParamRows { rows, row_numel, replicated })
            .collect();
        layout::RowLayout::new(&rows, gran(granularity)?, t).map(PyRowLayout).map_err(to_py)
    }

    /// Number of blocks.
    #[getter]
    fn blocks(&self) -> usize {
        self.0.blocks
    }

    /// Elements per block.
    #[getter]
    fn block_numel(&self) -> u64 {
        self.0.block_numel
    }

    /// Elements of the whole buffer, padding included.
    #[getter]
    fn padded(&self) -> u64 {
        self.0.padded()
    }

    /// `(offset in a block, slot rows, [(first row, rows) per block])` per parameter.
    #[getter]
    fn places(&self) -> Vec<(u64, u64, Vec<(u64, u64)>)> {
        self.0.params.iter().map(|p| (p.offset, p.slot_rows, p.chunks.clone())).collect()
    }

    /// `(start, end)` of the whole buffer that `rank` holds at `granularity`.
    fn range(&self, granularity: &str, rank: usize) -> PyResult<(u64, u64)> {
        let r = self.0.range(gran(granularity)?, rank).map_err(to_py)?;
        Ok((r.start, r.end))
    }
}

/// The plan one rank runs for a collective, as JSON (for inspection and tests).
#[pyfunction]
#[pyo3(signature = (collective, world, group_size, rank, numel, elem_size=4, root=0, chunk_bytes=1<<20, max_chunks=8))]
#[allow(clippy::too_many_arguments)]
fn describe_plan(
    collective: &str,
    world: usize,
    group_size: usize,
    rank: usize,
    numel: u64,
    elem_size: u64,
    root: usize,
    chunk_bytes: u64,
    max_chunks: u32,
) -> PyResult<String> {
    let c = match collective {
        "all_gather" => Collective::AllGather,
        "reduce_scatter" => Collective::ReduceScatter,
        "all_reduce" => Collective::AllReduce,
        "broadcast" => Collective::Broadcast,
        "reduce" => Collective::Reduce,
        "barrier" => Collective::Barrier,
        other => return Err(PyValueError::new_err(format!("unknown collective {other:?}"))),
    };
    let topology = if group_size == 0 { None } else { Some(Topology::new(world, group_size).map_err(to_py)?) };
    let req = planner::Request {
        collective: c,
        topology,
        world,
        rank,
        numel,
        elem_size,
        root,
        chunks: ChunkPolicy::fixed(chunk_bytes, max_chunks),
    };
    let plan = planner::plan(&req).map_err(to_py)?;
    serde_json::to_string(&plan).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Runs the cost model: a Request as JSON in, a Report as JSON out (see paro-core cost/request.rs, cost/report.rs).
#[pyfunction]
fn estimate(request: &str) -> PyResult<String> {
    paro_core::cost::estimate_json(request).map_err(to_py)
}

/// The cost model's cluster (JSON) of `world` GPUs of a preset class (a100, h100, h800) in groups of
/// `group_size`, `inter_gbit` Gbit/s per GPU between groups, computing at `efficiency` of the bf16 peak.
#[pyfunction]
fn gpu_cluster(name: &str, world: usize, group_size: usize, inter_gbit: f64, efficiency: f64) -> PyResult<String> {
    let preset = paro_core::cost::GpuPreset::named(name).map_err(to_py)?;
    let cluster = preset.cluster(world, group_size, inter_gbit, efficiency).map_err(to_py)?;
    serde_json::to_string(&cluster).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Builds the C++ `paro` Backend over Gloo sub-backends (intra and inter may be None); its device sub-backends come
/// from the device factory with `device_key` (negative: none; see `set_device_factory`).
#[pyfunction]
#[pyo3(signature = (world, group_size, rank, chunk_bytes, max_chunks, intra, inter, global_, device_key=-1, links=[0.0; 4]))]
#[allow(clippy::too_many_arguments)]
fn create_backend<'py>(
    py: Python<'py>,
    world: i32,
    group_size: i32,
    rank: i32,
    chunk_bytes: u64,
    max_chunks: u32,
    intra: Option<Bound<'py, PyAny>>,
    inter: Option<Bound<'py, PyAny>>,
    global_: Bound<'py, PyAny>,
    device_key: i64,
    links: [f64; 4],
) -> PyResult<Bound<'py, PyAny>> {
    let shape = bridge::ffi::Shape { world, group_size, rank, chunk_bytes, max_chunks, links };
    bridge::topology_of(&shape).map_err(to_py)?;
    let ptr = |o: &Option<Bound<'py, PyAny>>| o.as_ref().map_or(0, |b| b.as_ptr() as usize);
    // SAFETY: the pointers are live Python objects held by this frame; the GIL is held.
    let obj =
        unsafe { bridge::ffi::create_backend(&shape, ptr(&intra), ptr(&inter), global_.as_ptr() as usize, device_key) }
            .map_err(|e| PyRuntimeError::new_err(e.what().to_string()))?;
    // SAFETY: create_backend returns a new reference.
    Ok(unsafe { Bound::from_owned_ptr(py, obj as *mut pyo3::ffi::PyObject) })
}

/// Sets the callable `(key, device: str) -> (intra, inter, global)` that makes a backend's sub-backends for device
/// tensors on first use (`create_backend(..., device_key=key)`); it is kept for the life of the process.
#[pyfunction]
fn set_device_factory(factory: Bound<'_, PyAny>) -> PyResult<()> {
    if !factory.is_callable() {
        return Err(PyValueError::new_err("paro: the device factory must be callable"));
    }
    // SAFETY: `factory` is a live Python object; the GIL is held; C++ takes its own reference.
    unsafe { bridge::ffi::set_device_factory(factory.as_ptr() as usize) }
        .map_err(|e| PyRuntimeError::new_err(e.what().to_string()))
}

/// Counters of a paro Backend object: bytes and operations per level since the last reset.
#[pyfunction]
fn backend_stats(backend: Bound<'_, PyAny>) -> PyResult<[[u64; 2]; 3]> {
    // SAFETY: `backend` is a live Python object; the GIL is held.
    let v = unsafe { bridge::ffi::backend_stats(backend.as_ptr() as usize) }
        .map_err(|e| PyValueError::new_err(e.what().to_string()))?;
    if v.len() != 6 {
        return Err(PyRuntimeError::new_err("paro: unexpected counter layout"));
    }
    Ok([[v[0], v[3]], [v[1], v[4]], [v[2], v[5]]])
}

/// Zeroes the counters of a paro Backend object.
#[pyfunction]
fn reset_backend_stats(backend: Bound<'_, PyAny>) -> PyResult<()> {
    // SAFETY: as above.
    unsafe { bridge::ffi::reset_backend_stats(backend.as_ptr() as usize) }
        .map_err(|e| PyValueError::new_err(e.what().to_string()))
}

#[pymodule]
fn _C(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyStrategy>()?;
    m.add("InvalidStrategyError", py.get_type::<InvalidStrategyError>())?;
    m.add("TopologyError", py.get_type::<TopologyError>())?;
    let codes: Vec<String> = CoreStrategy::all_valid().iter().map(CoreStrategy::code).collect();
    m.add("STRATEGIES", codes)?;
    let aliases: Vec<(&str, &str)> = paro_core::strategy::ALIASES.to_vec();
    m.add("ALIASES", aliases)?;
    m.add_function(wrap_pyfunction!(check_topology, m)?)?;
    m.add_function(wrap_pyfunction!(subgroup_shape, m)?)?;
    m.add_class::<PyRowLayout>()?;
    m.add_function(wrap_pyfunction!(describe_plan, m)?)?;
    m.add_function(wrap_pyfunction!(estimate, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_cluster, m)?)?;
    let gpus: Vec<&str> = paro_core::cost::GPU_PRESETS.iter().map(|p| p.name).collect();
    m.add("GPU_PRESETS", gpus)?;
    m.add_function(wrap_pyfunction!(create_backend, m)?)?;
    m.add_function(wrap_pyfunction!(set_device_factory, m)?)?;
    m.add_function(wrap_pyfunction!(backend_stats, m)?)?;
    m.add_function(wrap_pyfunction!(reset_backend_stats, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("TORCH_VERSION", BUILT_WITH_TORCH.trim_end().rsplit("==").next().unwrap_or_default())?;
    Ok(())
}
