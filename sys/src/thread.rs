//! Threads that change namespaces.

use std::io;

/// Runs `f` on a short-lived thread of its own and returns its result. For namespace changes
/// (`setns`, `unshare` of the mount, network or UTS namespace): they apply to the calling
/// thread only, so the caller's threads stay where they are and the changed one ends with `f`.
pub fn on_own_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> io::Result<T> {
    std::thread::Builder::new()
        .name("grove-ns".into())
        .spawn(f)?
        .join()
        .map_err(|_| io::Error::other("a namespace thread panicked"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returns_the_result_and_reports_a_panic() {
        assert_eq!(on_own_thread(|| 7).unwrap(), 7);
        let e = on_own_thread(|| -> u8 { panic!("boom") }).unwrap_err();
        assert!(e.to_string().contains("panicked"), "{e}");
    }
}
