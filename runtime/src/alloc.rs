//! Process-wide allocation settings for a process that writes SQLite: the global allocator,
//! and settings applied once at start-up, before the first connection, by each binary's
//! `main` (through [`crate::process_main`] or [`tune_allocation`]). They trade a little idle
//! memory for fewer page faults and fewer instructions per event.

/// Every Rust allocation of every binary linking this crate (the three services, the tests'
/// tools, the benchmark) goes through mimalloc rather than glibc's malloc: a call's buffers,
/// futures and strings are many small short-lived allocations, and glibc spent 12–15 % of
/// each service's instructions in malloc and free. `bench --callgrind --flows 2000`, one
/// sitting: 270 135 instructions per event in total with glibc, 249 394 with mimalloc
/// (producer 123k → 113k, consumer 101k → 95k, relay 46k → 42k). SQLite keeps its own
/// allocations on glibc (its lookaside buffers serve most of them). Memory goes back to the
/// kernel as before: mimalloc purges freed pages on its own after a short delay, and
/// [`release_free_memory`] forces it after a burst of connections. mimalloc is built without
/// transparent huge pages (`no_thp`): with them, its arenas were backed by 2 MiB pages and
/// the services' peak RSS doubled (producer/consumer/relay 25/35/30 MiB against 12/15/11
/// with glibc, `bench --flows 10000`); without, 14/17/13 MiB.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Applies the allocation settings, once per process (later calls do nothing).
///
/// - SQLite keeps no memory statistics: with them on, every allocation takes a global mutex.
///   This only takes effect before SQLite initialises, which is why it runs at start-up.
/// - glibc keeps freed memory for reuse instead of handing it back to the kernel after every
///   transaction (trim threshold 64 MiB, mmap threshold 4 MiB): a writer thread allocates and
///   frees page buffers at each commit, and trimming them each time costs page faults and TLB
///   shootdowns on every following transaction. Measured with `bench --flows 2000` on a
///   shared 2-core machine (three runs each): the same peak RSS with and without
///   (producer/consumer/relay 10/12/9 MiB), and the producer's CPU per event 42–62 µs with
///   the setting against 68–85 µs without.
pub fn tune_allocation() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Unsafe FFI: neither setting has a safe wrapper.
        #[allow(unsafe_code)]
        // SAFETY: `sqlite3_config` takes an int for this option. Called before SQLite is
        // initialised it takes effect; afterwards it answers SQLITE_MISUSE and changes
        // nothing, which is harmless.
        unsafe {
            rusqlite::ffi::sqlite3_config(rusqlite::ffi::SQLITE_CONFIG_MEMSTATUS, 0 as std::ffi::c_int);
        }
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        #[allow(unsafe_code)]
        // SAFETY: mallopt only changes glibc's tuning parameters.
        unsafe {
            libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
            libc::mallopt(libc::M_MMAP_THRESHOLD, 4 << 20);
        }
    });
}

/// Returns free memory to the kernel: mimalloc's freed pages (`mi_collect(true)`, the Rust
/// side) and, with glibc, every whole free page of its arenas (`malloc_trim(0)`, SQLite's
/// side, which the trim threshold above keeps otherwise). The servers call it once a burst of
/// connections is over (`server_limits`). True when glibc returned memory (mimalloc does not
/// say).
pub fn release_free_memory() -> bool {
    // Unsafe FFI: neither call has a safe wrapper.
    #[allow(unsafe_code)]
    // SAFETY: mi_collect only walks mimalloc's own heaps, under its own synchronisation.
    unsafe {
        libmimalloc_sys::mi_collect(true);
    }
    trim_glibc()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim_glibc() -> bool {
    // Unsafe FFI: glibc's malloc_trim has no safe wrapper.
    #[allow(unsafe_code)]
    // SAFETY: malloc_trim only walks glibc's own arenas under their locks.
    unsafe {
        libc::malloc_trim(0) == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim_glibc() -> bool {
    false
}
