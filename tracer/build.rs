// Link libtorch_cuda even though no symbol of it is referenced: it registers
// the CUDA backend from a static initializer, and without it libtorch
// silently reports CUDA as unavailable. Also record libtorch's directory as
// an rpath so binaries find it without LD_LIBRARY_PATH.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=VIRTUAL_ENV");
    let Some(lib_dir) = libtorch_lib_dir() else {
        println!(
            "cargo:warning=libtorch lib directory not found; binaries will need LD_LIBRARY_PATH"
        );
        return;
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    if lib_dir.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}

/// libtorch's lib directory: `$LIBTORCH/lib`, or torch's package in the active
/// virtualenv (the `LIBTORCH_USE_PYTORCH=1` setup of the README).
fn libtorch_lib_dir() -> Option<PathBuf> {
    if let Ok(root) = std::env::var("LIBTORCH") {
        return Some(PathBuf::from(root).join("lib"));
    }
    let venv = PathBuf::from(std::env::var("VIRTUAL_ENV").ok()?);
    let lib = venv.join("lib");
    std::fs::read_dir(&lib)
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path().join("site-packages/torch/lib"))
        .find(|p| p.is_dir())
}
