//! Builds the C++ c10d backend (cpp/) against the installed torch, through cxx.
//!
//! torch is found through PARO_TORCH_DIR, else by asking the target Python (PYO3_PYTHON, else python3);
//! pip's build isolation hides site-packages, so the probe is retried without PYTHONPATH.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn probe(python: &str, code: &str, clean_env: bool) -> Option<String> {
    let mut cmd = Command::new(python);
    cmd.args(["-c", code]);
    if clean_env {
        cmd.env_remove("PYTHONPATH").env_remove("PYTHONNOUSERSITE").env_remove("PYTHONHOME");
    }
    let out = cmd.output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let python = env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".into());
    let torch_code =
        "import importlib.util, os; s = importlib.util.find_spec('torch'); print(os.path.dirname(s.origin))";
    let torch_dir = env::var("PARO_TORCH_DIR").ok().or_else(|| probe(&python, torch_code, false)).or_else(|| {
        let found = probe(&python, torch_code, true);
        if found.is_some() {
            println!("cargo:warning=torch found outside the isolated build environment");
        }
        found
    });
    let Some(torch_dir) = torch_dir else {
        panic!(
            "paro-torch: cannot find torch for {python}. Install torch>=2.11,<2.16 first, or set PARO_TORCH_DIR to \
             the torch package directory (the folder that holds include/ and lib/)."
        );
    };
    let torch = PathBuf::from(&torch_dir);
    let py_include = probe(&python, "import sysconfig; print(sysconfig.get_paths()['include'])", true)
        .expect("paro-torch: cannot ask Python for its include directory");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repository root");

    let mut build = cxx_build::bridge("src/bridge.rs");
    build
        .file(root.join("cpp/paro_backend.cc"))
        .file(root.join("cpp/handoff.cc"))
        .include(&root)
        .include(torch.join("include"))
        .include(torch.join("include/torch/csrc/api/include"))
        .include(&py_include)
        .std("c++20")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .warnings(false)
        .flag_if_supported("-Wno-unused-parameter");
    if let Ok(level) = env::var("PARO_CXX_OPT") {
        build.opt_level_str(&level);
    }
    build.compile("paro_cxx");

    println!("cargo:rustc-link-search=native={}", torch.join("lib").display());
    for lib in ["torch", "torch_cpu", "c10"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/../torch/lib");
    for f in [
        "src/bridge.rs",
        "../../cpp/bridge.h",
        "../../cpp/paro_backend.h",
        "../../cpp/paro_backend.cc",
        "../../cpp/handoff.cc",
    ] {
        println!("cargo:rerun-if-changed={f}");
    }
    for v in ["PYO3_PYTHON", "PARO_TORCH_DIR", "PARO_CXX_OPT"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
}
