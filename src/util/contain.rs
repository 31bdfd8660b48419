//! Third-party decoders that panic on malformed input (the Arrow IPC reader does, on a cut or
//! mutated file) contained: the panic becomes an error the caller names the input in, and the
//! command line's panic hook ([`quiet_hook`]) stays silent for it. Only the decoder's own calls
//! run contained — never megatrain's code, whose panics are bugs to see.

use std::cell::Cell;

thread_local! {
    /// How deep this thread is inside [`contain`].
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Run `f`; a panic inside it is returned as its message.
pub fn contain<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    DEPTH.with(|d| d.set(d.get() + 1));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    DEPTH.with(|d| d.set(d.get() - 1));
    r.map_err(|p| {
        p.downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into())
    })
}

/// Whether this thread is inside [`contain`].
pub fn is_contained() -> bool {
    DEPTH.with(Cell::get) > 0
}

/// Install a panic hook that stays silent for a contained panic and otherwise does what the
/// hook before it did (the command line installs it once, first thing).
pub fn quiet_hook() {
    let before = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !is_contained() {
            before(info);
        }
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_inside_is_its_message_and_depth_unwinds() {
        assert_eq!(contain(|| 7).unwrap(), 7);
        let e = contain(|| -> u32 { panic!("bad offset {}", 3) }).unwrap_err();
        assert_eq!(e, "bad offset 3");
        assert!(!is_contained());
    }
}
