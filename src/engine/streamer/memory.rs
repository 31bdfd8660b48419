//! What a run holds in host memory, by kind: the state every phase keeps (the host store), the
//! streamer's own host buffers, and the device's memory where it is host memory (the CPU
//! device) — against which the process's peak resident set is measured.

use super::Streamer;

/// Host bytes of a run, by what holds them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct HostMemory {
    /// The host store's regions (master, gradients, moments in RAM).
    pub state: u64,
    /// The streamer's host buffers: offloaded activations, lean gradient buffers, gathered
    /// params and landed gradients (ZeRO stage 3).
    pub buffers: u64,
    /// The device's peak allocation when it lives in host memory (the CPU device); 0 for a GPU.
    pub device: u64,
}

impl HostMemory {
    /// The sum.
    pub fn total(&self) -> u64 {
        self.state + self.buffers + self.device
    }
}

impl Streamer {
    /// The run's host memory now ([`HostMemory`]).
    pub fn host_memory(&self) -> HostMemory {
        let buffers = self.saved.iter().map(|b| 4 * b.len() as u64).sum::<u64>()
            + self
                .lean
                .iter()
                .flatten()
                .map(|b| 4 * b.len() as u64)
                .sum::<u64>()
            + self
                .gathered
                .iter()
                .chain(&self.landing)
                .map(|b| 4 * b.len() as u64)
                .sum::<u64>();
        HostMemory {
            state: self.store.mapped_bytes(),
            buffers,
            device: match self.device.memory_in_host() {
                true => self.device.memory().peak,
                false => 0,
            },
        }
    }
}
