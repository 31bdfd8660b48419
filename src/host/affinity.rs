//! Thread placement: pinning the calling thread to a set of CPUs.

use crate::{Error, Result};

/// Pin the calling thread to `cpus` (OS indices) with `sched_setaffinity`.
pub fn pin_current_thread(cpus: &[usize]) -> Result<()> {
    // SAFETY: cpu_set_t is plain data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
    for &c in cpus {
        if c >= max {
            return Err(Error::bad_input(
                "CPU",
                c.to_string(),
                format!("beyond the {max} CPUs a cpu_set_t holds"),
                None,
            ));
        }
        // SAFETY: c < CPU_SETSIZE, checked above.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: pid 0 = the calling thread; `set` is a valid cpu_set_t of the size we pass.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(Error::system(
            "sched_setaffinity",
            format!("pin thread to CPUs {cpus:?}"),
            std::io::Error::last_os_error(),
        )
        .with_fix(
            "check the CPUs are online and allowed to this process (taskset, cgroup cpuset)",
        ));
    }
    Ok(())
}

/// The CPUs the calling thread may run on.
pub fn current_affinity() -> Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain data.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer of the size we pass.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Err(Error::system(
            "sched_getaffinity",
            "read thread affinity",
            std::io::Error::last_os_error(),
        ));
    }
    let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: i < CPU_SETSIZE.
    Ok((0..max)
        .filter(|&i| unsafe { libc::CPU_ISSET(i, &set) })
        .collect())
}

/// Parse a Linux CPU list ("0-13,112-125") into CPU indices.
pub fn parse_cpu_list(list: &str) -> Result<Vec<usize>> {
    let mut out = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || Error::bad_input("CPU list", list, format!("`{part}` is not N or N-M"), None);
        match part.split_once('-') {
            Some((a, b)) => {
                let a: usize = a.trim().parse().map_err(|_| bad())?;
                let b: usize = b.trim().parse().map_err(|_| bad())?;
                if b < a {
                    return Err(bad());
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().map_err(|_| bad())?),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-2,5").unwrap(), vec![0, 1, 2, 5]);
        assert_eq!(parse_cpu_list("").unwrap(), Vec::<usize>::new());
        assert!(parse_cpu_list("3-1").is_err());
        assert!(parse_cpu_list("a").is_err());
    }

    #[test]
    fn pin_and_read_back_in_a_thread() {
        // A fresh thread, so the test binary's other threads keep their affinity.
        std::thread::spawn(|| {
            pin_current_thread(&[0]).unwrap();
            assert_eq!(current_affinity().unwrap(), vec![0]);
        })
        .join()
        .unwrap();
    }
}
