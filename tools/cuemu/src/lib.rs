//! cuemu: the CUDA driver, NVRTC and cuBLAS as an unmodified CUDA program sees them, on a
//! machine without a GPU — what QEMU is to an operating system. `tools/cuemu.sh CMD…` runs
//! CMD with this library in place of `libcuda.so.1`, `libcublas.so.12`, `libnvrtc.so.12` and
//! `libnccl.so.2`.
//!
//! - Device memory is host memory, one mapping per allocation with guard pages and canaries,
//!   poisoned on allocation and on free ([`memory`]).
//! - Streams are FIFO queues run by their own threads; events, waits and host functions keep
//!   CUDA's semantics, and every command's device accesses are checked against the
//!   happens-before order the program established ([`stream`], [`clock`]).
//! - The emulated NVRTC forwards to the real one (errors, warnings and PTX stay real) and also
//!   builds the same source for the host with a SIMT runtime (`simt/`): one fiber per CUDA
//!   thread, real barriers and warp rendezvous ([`nvrtc`], [`hostbuild`], [`launch`]).
//! - cuBLAS GEMMs validate their arguments as cuBLAS documents and run on the handle's stream
//!   ([`cublas`]).
//! - NCCL's collectives run across the processes of one job through shared memory, with their
//!   buffers in the hazard checks and every rank's call compared with the others' ([`nccl`]).
//!
//! What it finds is reported on stderr (`cuemu: error: …`, and appended to `$CUEMU_REPORT`),
//! named with the kernel, launch and stream, and makes the context fail as a GPU fault would.
//! Nothing it measures is a GPU time.

#![allow(non_snake_case)]
#![allow(clippy::missing_safety_doc)]

mod api;
mod clock;
mod config;
mod cublas;
mod driver;
mod hostbuild;
mod launch;
mod memory;
mod nccl;
mod nvrtc;
mod profile;
mod ptx;
mod report;
mod simt;
mod stream;

mod stubs {
    include!(concat!(env!("OUT_DIR"), "/stubs.rs"));
}
