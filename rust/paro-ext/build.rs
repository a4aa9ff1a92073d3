//! Builds the C++ c10d backend (cpp/, inside this crate so that the sdist carries it) against the torch installed
//! for the target Python, through cxx.
//!
//! The target Python is PYO3_PYTHON (maturin sets it to the interpreter it builds for), else python3; it must be able
//! to `import torch`. Under pip's default build isolation it cannot: paro-torch is built with
//! `pip install --no-build-isolation`, and the build backend (build_backend/paro_build.py) says so before cargo
//! starts. PARO_TORCH_DIR (the torch package directory, the folder that holds include/ and lib/) picks another torch.
//!
//! What the build learns from torch: its headers and libraries, its C++ ABI (`torch._C._GLIBCXX_USE_CXX11_ABI`,
//! passed on as `_GLIBCXX_USE_CXX11_ABI`), and its version, which the extension carries (`_C.TORCH_VERSION`, see
//! src/lib.rs) so that `import paro_torch` can refuse another torch minor before it loads the extension.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Run by the target Python: one line with torch's directory, version and C++ ABI flag, and Python's include
/// directory, behind a tag (whatever importing torch prints is skipped).
const PROBE: &str = r#"
import os, sys, sysconfig
if len(sys.argv) > 1:
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))
import torch
found = [os.path.dirname(os.path.abspath(torch.__file__)), torch.__version__,
         str(int(torch._C._GLIBCXX_USE_CXX11_ABI)), sysconfig.get_paths()["include"]]
print("\n" + "\t".join(["paro-probe", *found]))
"#;

struct Torch {
    dir: PathBuf,
    version: String,
    cxx11_abi: String,
    py_include: PathBuf,
}

fn probe(python: &str, torch_dir: Option<&str>) -> Torch {
    let mut cmd = Command::new(python);
    cmd.args(["-c", PROBE]).args(torch_dir);
    let out = cmd.output().unwrap_or_else(|e| panic!("paro-torch: cannot run {python}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let found = stdout.lines().rev().find_map(|line| line.strip_prefix("paro-probe\t"));
    let fields: Vec<&str> = found.map(|f| f.split('\t').collect()).unwrap_or_default();
    if !out.status.success() || fields.len() != 4 {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let why = stderr.lines().last().unwrap_or("no output");
        panic!(
            "paro-torch: {python} cannot import torch ({why}).\n\
             paro-torch compiles against the torch installed where it is installed: install torch first, then \
             build without pip's build isolation, which hides it:\n    \
             pip install --no-build-isolation .\n\
             (or set PARO_TORCH_DIR to a torch package directory)"
        );
    }
    let dir = PathBuf::from(fields[0]);
    if let Some(wanted) = torch_dir {
        let wanted = Path::new(wanted).canonicalize().unwrap_or_else(|_| PathBuf::from(wanted));
        let found = dir.canonicalize().unwrap_or_else(|_| dir.clone());
        assert!(
            found == wanted,
            "paro-torch: PARO_TORCH_DIR={} but {python} imports torch from {}",
            wanted.display(),
            found.display()
        );
    }
    Torch { dir, version: fields[1].into(), cxx11_abi: fields[2].into(), py_include: PathBuf::from(fields[3]) }
}

fn main() {
    let python = env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".into());
    let torch = probe(&python, env::var("PARO_TORCH_DIR").ok().as_deref());
    // read at run time: a build script compiled for one copy of the sources may be reused for another (an unpacked
    // sdist sharing the target directory), and env!() would point it at the first copy's C++ files
    let crate_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));

    let mut build = cxx_build::bridge("src/bridge.rs");
    build
        .file(crate_dir.join("cpp/paro_backend.cc"))
        .file(crate_dir.join("cpp/handoff.cc"))
        .include(&crate_dir) // the sources include "cpp/..."
        .include(torch.dir.join("include"))
        .include(torch.dir.join("include/torch/csrc/api/include"))
        .include(&torch.py_include)
        .std("c++20")
        .define("_GLIBCXX_USE_CXX11_ABI", torch.cxx11_abi.as_str())
        .warnings(false)
        .flag_if_supported("-Wno-unused-parameter");
    if let Ok(level) = env::var("PARO_CXX_OPT") {
        build.opt_level_str(&level);
    }
    build.compile("paro_cxx");

    println!("cargo:rustc-link-search=native={}", torch.dir.join("lib").display());
    for lib in ["torch", "torch_cpu", "c10"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    // Where pip puts torch beside paro_torch; `import paro_torch` imports torch first anyway, which loads these.
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/../torch/lib");
    println!("cargo:rustc-env=PARO_TORCH_VERSION={}", torch.version);

    for f in ["src/bridge.rs", "cpp/bridge.h", "cpp/paro_backend.h", "cpp/paro_backend.cc", "cpp/handoff.cc"] {
        println!("cargo:rerun-if-changed={f}");
    }
    // another torch (an upgrade in place, or another environment) means other headers, ABI and version
    println!("cargo:rerun-if-changed={}", torch.dir.join("version.py").display());
    for v in ["PYO3_PYTHON", "PARO_TORCH_DIR", "PARO_CXX_OPT"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
}
