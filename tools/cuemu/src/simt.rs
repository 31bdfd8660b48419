//! The SIMT runtime library (`simt/runtime.cpp`, built by [`crate::hostbuild`]) as Rust sees
//! it: the C structs of `simt/cuemu_abi.h`, field for field, and `cuemu_run_block`.

use crate::hostbuild;
use std::ffi::{c_char, c_void, CString};
use std::sync::OnceLock;

pub type KernelFn = unsafe extern "C" fn(params: *mut *mut c_void);

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Dim3 {
    pub x: u32,
    pub y: u32,
    pub z: u32,
}

impl Dim3 {
    pub fn count(&self) -> u64 {
        u64::from(self.x) * u64::from(self.y) * u64::from(self.z)
    }
}

impl std::fmt::Display for Dim3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "({},{},{})", self.x, self.y, self.z)
    }
}

#[repr(C)]
pub struct BlockArgs {
    pub kernel: KernelFn,
    pub params: *mut *mut c_void,
    pub grid: Dim3,
    pub block: Dim3,
    pub block_idx: Dim3,
    pub shared_capacity: usize,
    pub dynamic_shared: usize,
    pub schedule: u32,
    pub seed: u64,
    pub poison: u8,
}

#[repr(C)]
pub struct BlockResult {
    pub code: i32,
    pub thread: Dim3,
    pub fault_address: u64,
    pub shared_base: u64,
    pub shared_end: u64,
    pub switches: u64,
    pub message: [c_char; 1024],
}

impl BlockResult {
    pub fn new() -> Self {
        BlockResult {
            code: 0,
            thread: Dim3::default(),
            fault_address: 0,
            shared_base: 0,
            shared_end: 0,
            switches: 0,
            message: [0; 1024],
        }
    }

    pub fn message(&self) -> String {
        let bytes: Vec<u8> = self
            .message
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Block error codes (`cuemu_abi.h`).
pub const FAULT: i32 = 6;
pub const TRAP: i32 = 5;
pub const SHARED_OVERFLOW: i32 = 4;

/// One entry of a program's kernel table (`cuemu_kernel_entry`).
#[repr(C)]
pub struct KernelEntry {
    pub name: *const c_char,
    pub run: KernelFn,
    pub signature: unsafe extern "C" fn() -> *const c_char,
}

const ABI: u32 = 1;

pub struct Runtime {
    pub run_block: unsafe extern "C" fn(*const BlockArgs, *mut BlockResult) -> i32,
}

/// The loaded runtime (built on first use).
pub fn runtime() -> Result<&'static Runtime, String> {
    static R: OnceLock<Result<Runtime, String>> = OnceLock::new();
    R.get_or_init(|| {
        let path = hostbuild::simt_library()?;
        let c = CString::new(path.display().to_string()).map_err(|_| "path with NUL".to_owned())?;
        // SAFETY: our own library; kept loaded for the process.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if h.is_null() {
            return Err(format!(
                "cannot load {}: {}",
                path.display(),
                hostbuild::dlerror()
            ));
        }
        // SAFETY: symbols runtime.cpp exports with these signatures.
        unsafe {
            let abi = libc::dlsym(h, c"cuemu_simt_abi".as_ptr());
            let run = libc::dlsym(h, c"cuemu_run_block".as_ptr());
            if abi.is_null() || run.is_null() {
                return Err(format!("{} is not the SIMT runtime", path.display()));
            }
            let abi: unsafe extern "C" fn() -> u32 = std::mem::transmute(abi);
            if abi() != ABI {
                return Err(format!(
                    "{} has ABI {}, cuemu needs {ABI}",
                    path.display(),
                    abi()
                ));
            }
            Ok(Runtime {
                run_block: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*const BlockArgs, *mut BlockResult) -> i32,
                >(run),
            })
        }
    })
    .as_ref()
    .map_err(Clone::clone)
}
