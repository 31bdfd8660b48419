//! Files the tests of the stack's modules make.

use std::path::Path;

/// An empty file at `p`, its folders made.
pub fn touch(p: &Path) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, b"").unwrap();
}

/// Headers of CUDA `version` (`cuda_bf16.h`, `cuda_runtime_api.h` saying the release) in `dir`.
pub fn headers(dir: &Path, version: i32) {
    touch(&dir.join("cuda_bf16.h"));
    std::fs::write(
        dir.join("cuda_runtime_api.h"),
        format!("/* x */\n#define CUDART_VERSION  {version}\n#define CUDART_VERSION_X 1\n"),
    )
    .unwrap();
}
