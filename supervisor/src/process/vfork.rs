//! Starting a child without copying the worker's address space.
//!
//! `std::process::Command` with a `pre_exec` hook must `fork()`: the kernel
//! copies the page tables of the whole worker (its runtime, its pools, its
//! buffers), write-protects every page, and each page a worker thread writes
//! afterwards takes a copy-on-write fault, while the child throws the copy
//! away at `exec`. Measured with `perf` on a one-shot Go executor at
//! concurrency 4, that was about a fifth of the worker's own CPU per step.
//! `posix_spawn` avoids it (`CLONE_VM | CLONE_VFORK`) but cannot arm
//! PDEATHSIG. So this module does what glibc's `posix_spawn` does, with the
//! steps the supervisor needs between clone and exec:
//!
//! 1. in the parent (the spawner thread): everything the child needs is
//!    prepared as C strings and raw file descriptors (the program's
//!    candidates along `PATH`, argv, envp, the working directory, the pipes,
//!    the cgroup file), and every signal is blocked on this thread;
//! 2. `clone(CLONE_VM | CLONE_VFORK)` on a stack of its own: the child shares
//!    the memory, the parent thread sleeps until the child execs or exits.
//!    With a cgroup, `clone3` with `CLONE_INTO_CGROUP` (x86-64, Linux 5.7+)
//!    starts the child in it: joining by a write to `cgroup.procs` takes the
//!    kernel's cgroup threadgroup lock for writing, which waits for an RCU
//!    grace period (measured here: 10.8 ms of a one-shot step's 15 ms from
//!    submit to `accepted` on an idle worker, with every fork on the host
//!    held meanwhile). Where `clone3` is refused (an older kernel, a seccomp
//!    filter, an unusable cgroup) the child joins by the write, as before;
//! 3. in the child, async-signal-safe system calls only, on the prepared data:
//!    every caught signal back to its default (a handler must never run in a
//!    child that shares the worker's memory) and SIGPIPE too (as `std` does),
//!    the signal mask emptied, `setpgid(0, 0)`, the cgroup join (unless
//!    `clone3` put it there), PDEATHSIG and
//!    the check that the parent is still there, the pipes onto 0/1/2,
//!    `chdir`, then `execve` of each candidate in turn (as `execvp`); on
//!    failure the errno is stored in the shared memory and the child exits;
//! 4. back in the parent: the signal mask restored; a failed child is reaped
//!    and its errno returned as the spawn's error, as `std` does.

use std::ffi::{CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// What the child needs, prepared before the clone (no allocation after it).
pub(crate) struct Prepared {
    /// The paths to try, in order (one for a path with a slash).
    candidates: Vec<CString>,
    argv: Vec<CString>,
    envp: Vec<CString>,
    cwd: CString,
    cgroup_procs: Option<CString>,
    /// The directory of `cgroup_procs`, for `CLONE_INTO_CGROUP`.
    cgroup_dir: Option<CString>,
}

/// The parent's ends of the child's stdio, and its pid.
pub(crate) struct Spawned {
    pub(crate) pid: libc::pid_t,
    pub(crate) stdin: OwnedFd,
    pub(crate) stdout: OwnedFd,
    pub(crate) stderr: OwnedFd,
}

fn cstring(bytes: &[u8], what: &str) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{what} contains a NUL byte"),
        )
    })
}

impl Prepared {
    /// `env` is the child's whole environment (later pairs win over earlier
    /// ones of the same name). A program without a slash is looked up along
    /// the child's `PATH` (glibc's default `/bin:/usr/bin` without one), as
    /// `execvp` does in a child whose environment is `env`.
    pub(crate) fn new(
        program: &Path,
        args: &[String],
        cwd: &Path,
        env: &[(OsString, OsString)],
        cgroup_procs: Option<CString>,
    ) -> io::Result<Prepared> {
        let mut merged: Vec<(&OsStr, &OsStr)> = Vec::with_capacity(env.len());
        for (k, v) in env {
            match merged.iter_mut().find(|(have, _)| *have == k.as_os_str()) {
                Some(slot) => slot.1 = v.as_os_str(),
                None => merged.push((k.as_os_str(), v.as_os_str())),
            }
        }
        let mut envp = Vec::with_capacity(merged.len());
        for (k, v) in &merged {
            if k.is_empty() || k.as_bytes().contains(&b'=') {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("invalid environment variable name {k:?}"),
                ));
            }
            let mut kv = k.as_bytes().to_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            envp.push(cstring(&kv, "an environment variable")?);
        }
        let prog = program.as_os_str().as_bytes();
        if prog.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "the program is empty",
            ));
        }
        let candidates = if prog.contains(&b'/') {
            vec![cstring(prog, "the program")?]
        } else {
            let path = merged
                .iter()
                .find(|(k, _)| k.as_bytes() == b"PATH")
                .map_or(&b"/bin:/usr/bin"[..], |(_, v)| v.as_bytes());
            let mut c = Vec::new();
            for dir in path.split(|b| *b == b':') {
                // an empty entry is the working directory, as for execvp
                let mut full = if dir.is_empty() {
                    b".".to_vec()
                } else {
                    dir.to_vec()
                };
                full.push(b'/');
                full.extend_from_slice(prog);
                c.push(cstring(&full, "the program")?);
            }
            c
        };
        let mut argv = Vec::with_capacity(args.len() + 1);
        argv.push(cstring(prog, "the program")?);
        for a in args {
            argv.push(cstring(a.as_bytes(), "an argument")?);
        }
        let cgroup_dir = cgroup_procs.as_ref().and_then(|procs| {
            let dir = Path::new(OsStr::from_bytes(procs.as_bytes())).parent()?;
            CString::new(dir.as_os_str().as_bytes()).ok()
        });
        Ok(Prepared {
            candidates,
            argv,
            envp,
            cwd: cstring(cwd.as_os_str().as_bytes(), "the working directory")?,
            cgroup_procs,
            cgroup_dir,
        })
    }
}

/// A pipe whose two ends are close-on-exec and above the standard fds (so
/// that moving one onto 0, 1 or 2 never overwrites another).
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: fds is a valid array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 just returned these two fds, owned by nobody else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    Ok((above_stdio(r)?, above_stdio(w)?))
}

fn above_stdio(fd: OwnedFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    // SAFETY: F_DUPFD_CLOEXEC on a valid fd returns a new fd we own.
    let n = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fcntl just returned this fd, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

/// The child's view, on the parent's memory (`CLONE_VM`): raw pointers into
/// `Prepared` and the pipes, and where the child leaves its errno.
struct ChildArgs {
    candidates: Vec<*const libc::c_char>,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    cwd: *const libc::c_char,
    cgroup_procs: *const libc::c_char,
    stdin: RawFd,
    stdout: RawFd,
    stderr: RawFd,
    parent: libc::pid_t,
    /// The highest signal number (`SIGRTMAX`), read before the clone.
    sigmax: libc::c_int,
    /// One past the highest fd the process may have open (`RLIMIT_NOFILE`,
    /// at most 65,536), read before the clone: where `close_range` is
    /// missing the child closes up to it one by one.
    fd_limit: libc::c_int,
    /// The open-file limit the child starts with, where the worker raised
    /// its own (see `limits`); read before the clone.
    nofile: Option<libc::rlimit>,
    /// 0 until the child fails before or at exec.
    errno: libc::c_int,
}

const CHILD_STACK: usize = 64 * 1024;

/// Starts `p` as the leader of a new process group with piped stdio and
/// PDEATHSIG armed (relative to the calling thread). Returns once the child
/// has exec'd; a failure before or at exec is returned as its errno.
pub(crate) fn spawn(p: &Prepared) -> io::Result<Spawned> {
    let (in_r, in_w) = pipe()?;
    let (out_r, out_w) = pipe()?;
    let (err_r, err_w) = pipe()?;
    let mut argv: Vec<*const libc::c_char> = p.argv.iter().map(|s| s.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = p.envp.iter().map(|s| s.as_ptr()).collect();
    envp.push(std::ptr::null());
    let mut args = ChildArgs {
        candidates: p.candidates.iter().map(|s| s.as_ptr()).collect(),
        argv,
        envp,
        cwd: p.cwd.as_ptr(),
        cgroup_procs: p
            .cgroup_procs
            .as_ref()
            .map_or(std::ptr::null(), |c| c.as_ptr()),
        stdin: in_r.as_raw_fd(),
        stdout: out_w.as_raw_fd(),
        stderr: err_w.as_raw_fd(),
        // SAFETY: getpid has no preconditions.
        parent: unsafe { libc::getpid() },
        sigmax: libc::SIGRTMAX(),
        fd_limit: fd_limit(),
        nofile: super::limits::for_children(),
        errno: 0,
    };
    // SAFETY: sigset_t is plain old data; sigfillset/pthread_sigmask get
    // valid pointers to sets we own.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
    }
    let cloned = clone_child(p, &mut args);
    // SAFETY: restores the mask saved above.
    unsafe {
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
    }
    let pid = cloned?;
    // SAFETY: the child wrote `errno` (if at all) before it exec'd or
    // exited, and this thread resumed only after that: no concurrent access.
    let errno = unsafe { std::ptr::read_volatile(&args.errno) };
    if errno != 0 {
        let mut status = 0;
        // SAFETY: reaps our own child, which has exited (it failed).
        while unsafe { libc::waitpid(pid, &mut status, 0) } < 0
            && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
        {}
        return Err(io::Error::from_raw_os_error(errno));
    }
    drop((in_r, out_w, err_w));
    Ok(Spawned {
        pid,
        stdin: in_w,
        stdout: out_r,
        stderr: err_r,
    })
}

/// Clones the child (every signal blocked on this thread): into its cgroup
/// with `clone3` where the kernel takes it, else with `clone`, and the child
/// joins by writing `cgroup.procs` (`args.cgroup_procs`). Returns once the
/// child has exec'd or exited (`CLONE_VFORK`); its pid.
fn clone_child(p: &Prepared, args: &mut ChildArgs) -> io::Result<libc::pid_t> {
    let mut stack = vec![0u8; CHILD_STACK];
    // SAFETY: the stack grows down on every Linux target this runs on; the
    // top, rounded down to 16 bytes, is inside the allocation.
    let top = unsafe { stack.as_mut_ptr().add(CHILD_STACK) };
    let top = (top as usize & !15) as *mut libc::c_void;
    if let Some(dir) = p.cgroup_dir.as_ref().filter(|_| clone3_usable()) {
        // SAFETY: a valid C string; the fd returned is ours alone.
        let fd = unsafe {
            libc::open(
                dir.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd >= 0 {
            // SAFETY: open just returned this fd, owned by nobody else.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            let procs = std::mem::replace(&mut args.cgroup_procs, std::ptr::null());
            // SAFETY: as for the clone below; `fd` is an open cgroup
            // directory and `stack`..`top` the child's stack.
            match unsafe { clone3_into_cgroup(args, stack.as_mut_ptr(), top, fd.as_raw_fd()) } {
                Ok(pid) => {
                    CLONE3_JOINS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    return Ok(pid);
                }
                Err(e) => {
                    clone3_refused(&e);
                    args.cgroup_procs = procs;
                }
            }
        }
    }
    // SAFETY: CLONE_VM | CLONE_VFORK: this thread is suspended until the
    // child execs or exits, so `args`, `p` and `stack` outlive every use the
    // child makes of them; the child runs `child_main`, which only makes
    // async-signal-safe system calls on that prepared data.
    let pid = unsafe {
        libc::clone(
            child_main,
            top,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            (args as *mut ChildArgs).cast(),
        )
    };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(pid)
}

/// `struct clone_args` of `clone3(2)` up to `cgroup` (`CLONE_ARGS_SIZE_VER2`).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// Cleared once `clone3` turned out to be missing here (an older kernel, or
/// a seccomp filter that answers ENOSYS or EPERM, as container runtimes'
/// default ones do): from then on every spawn joins by the write.
static CLONE3_USABLE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Children started in their cgroup by `clone3` (for the tests).
static CLONE3_JOINS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many children this process started in their cgroup by `clone3`.
#[cfg(test)]
pub(crate) fn clone3_joins() -> u64 {
    CLONE3_JOINS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether this kernel and its seccomp filter let `clone3` through (the
/// probe passes no arguments: EINVAL where it exists, nothing is created).
#[cfg(test)]
pub(crate) fn clone3_exists() -> bool {
    // SAFETY: clone3 with a null pointer and size 0 is refused before it
    // reads anything.
    let r = unsafe { libc::syscall(libc::SYS_clone3, std::ptr::null::<u8>(), 0usize) };
    cfg!(target_arch = "x86_64")
        && r < 0
        && io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL)
}

/// Turns the `clone3` path on or off (tests of the fallback); the previous
/// setting.
#[cfg(test)]
pub(crate) fn set_clone3_usable(on: bool) -> bool {
    CLONE3_USABLE.swap(on, std::sync::atomic::Ordering::Relaxed)
}

fn clone3_usable() -> bool {
    cfg!(target_arch = "x86_64") && CLONE3_USABLE.load(std::sync::atomic::Ordering::Relaxed)
}

/// Notes why `clone3` failed: a missing system call or flag (ENOSYS, E2BIG,
/// EPERM from a filter, EINVAL from a kernel before 5.7 that has `clone3`
/// but not `CLONE_INTO_CGROUP`) is not tried again; a refusal of this
/// cgroup (EBUSY, EBADF, EACCES, EOPNOTSUPP, …) is this spawn's alone, and
/// the write to `cgroup.procs` will say the same or succeed.
fn clone3_refused(e: &io::Error) {
    let missing = matches!(
        e.raw_os_error(),
        Some(libc::ENOSYS) | Some(libc::E2BIG) | Some(libc::EPERM) | Some(libc::EINVAL)
    );
    if missing && CLONE3_USABLE.swap(false, std::sync::atomic::Ordering::Relaxed) {
        tracing::info!(error = %e, "clone3 into a cgroup is not available here: children join their cgroup by writing cgroup.procs (each start may wait ~10 ms for the kernel)");
    } else {
        tracing::debug!(error = %e, missing, "clone3 into a cgroup refused; the child joins it by cgroup.procs");
    }
}

/// `clone3(CLONE_VM | CLONE_VFORK | CLONE_INTO_CGROUP)`: the child starts
/// in the cgroup `cgroup_fd` and runs `child_main(args)` on the stack from
/// `base` to `top` (16-byte aligned); the parent thread resumes once it
/// exec'd or exited. The pid, or the system call's error.
///
/// # Safety
/// As for `libc::clone` with `CLONE_VM | CLONE_VFORK`: `args` and the stack
/// outlive the child's use of them (they do: this thread is suspended until
/// it execs or exits), and `child_main` only makes async-signal-safe calls.
#[cfg(target_arch = "x86_64")]
unsafe fn clone3_into_cgroup(
    args: &mut ChildArgs,
    base: *mut u8,
    top: *mut libc::c_void,
    cgroup_fd: RawFd,
) -> io::Result<libc::pid_t> {
    let ca = CloneArgs {
        flags: (libc::CLONE_VM | libc::CLONE_VFORK) as u64 | CLONE_INTO_CGROUP,
        exit_signal: libc::SIGCHLD as u64,
        stack: base as u64,
        stack_size: top as u64 - base as u64,
        cgroup: cgroup_fd as u64,
        ..CloneArgs::default()
    };
    let arg: *mut libc::c_void = (args as *mut ChildArgs).cast();
    let entry: extern "C" fn(*mut libc::c_void) -> libc::c_int = child_main;
    let ret: i64;
    // The child comes back from the system call on its own (empty) stack
    // with rax = 0: it must not return into this function's frame, so it
    // calls `child_main` right there and exits with its value (it never
    // returns: it execs or `_exit`s). The parent gets the pid or -errno in
    // rax; the system call changes only rax, rcx and r11.
    core::arch::asm!(
        "syscall",
        "test rax, rax",
        "jnz 2f",
        "xor ebp, ebp",
        "mov rdi, r12",
        "call r13",
        "mov edi, eax",
        "mov eax, 231", // exit_group
        "syscall",
        "ud2",
        "2:",
        inlateout("rax") libc::SYS_clone3 => ret,
        in("rdi") &ca as *const CloneArgs,
        in("rsi") std::mem::size_of::<CloneArgs>(),
        in("r12") arg,
        in("r13") entry,
        lateout("rcx") _,
        lateout("r11") _,
        options(nostack),
    );
    if ret < 0 {
        return Err(io::Error::from_raw_os_error(-ret as i32));
    }
    Ok(ret as libc::pid_t)
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn clone3_into_cgroup(
    _args: &mut ChildArgs,
    _base: *mut u8,
    _top: *mut libc::c_void,
    _cgroup_fd: RawFd,
) -> io::Result<libc::pid_t> {
    Err(io::Error::from_raw_os_error(libc::ENOSYS))
}

/// One past the highest fd number this process may use (its soft
/// `RLIMIT_NOFILE`, at most 65,536): the fallback's bound for closing them.
fn fd_limit() -> libc::c_int {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the rlimit we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return 1024;
    }
    r.rlim_cur.min(65_536) as libc::c_int
}

/// Moves `fd` onto `target`, without close-on-exec.
///
/// # Safety
/// Between clone and exec: async-signal-safe calls only.
unsafe fn onto(fd: RawFd, target: RawFd) -> bool {
    if fd == target {
        return libc::fcntl(fd, libc::F_SETFD, 0) == 0;
    }
    libc::dup2(fd, target) == target
}

extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the parent's ChildArgs, alive and not touched by the
    // parent (suspended by CLONE_VFORK) until this child execs or exits.
    // Every call below is an async-signal-safe system call on data prepared
    // before the clone; nothing allocates, locks or unwinds.
    unsafe {
        let a = &mut *(arg as *mut ChildArgs);
        let fail = |a: &mut ChildArgs| -> ! {
            let e = *libc::__errno_location();
            std::ptr::write_volatile(&mut a.errno, if e == 0 { libc::EINVAL } else { e });
            libc::_exit(127)
        };
        // no handler of the worker's may run in here: caught signals back
        // to their default (exec would do that too), SIGPIPE as std leaves it
        for sig in 1..=a.sigmax {
            let mut sa: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, std::ptr::null(), &mut sa) == 0
                && (sa.sa_sigaction != libc::SIG_DFL && sa.sa_sigaction != libc::SIG_IGN
                    || sig == libc::SIGPIPE)
            {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(sig, &dfl, std::ptr::null_mut());
            }
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());

        // leader of its own group, so the whole tree can be signalled
        if libc::setpgid(0, 0) != 0 {
            fail(a);
        }
        // join our own cgroup ("0" is the writing process); a failure is not
        // fatal: the parent notices and carries on without
        if !a.cgroup_procs.is_null() {
            let fd = libc::open(a.cgroup_procs, libc::O_WRONLY | libc::O_CLOEXEC);
            if fd >= 0 {
                let _ = libc::write(fd, b"0".as_ptr().cast(), 1);
                libc::close(fd);
            }
        }
        // die with the spawner thread (and so with the process)
        if libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        ) != 0
        {
            fail(a);
        }
        // the parent died before PDEATHSIG was armed: nobody will kill us
        if libc::getppid() != a.parent {
            libc::_exit(1);
        }
        if !onto(a.stdin, 0) || !onto(a.stdout, 1) || !onto(a.stderr, 2) {
            fail(a);
        }
        // nothing else of this process reaches the executor: the worker's
        // own fds are close-on-exec, but what it inherited without the flag
        // (a shell's redirection, a service manager's sockets) was handed to
        // every executor (security audit: a secret file the worker's parent
        // had open on fd 7). The child has its own fd table (no CLONE_FILES)
        if libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            0 as libc::c_uint,
        ) != 0
        {
            for fd in 3..a.fd_limit {
                libc::close(fd);
            }
        }
        // the limit the worker was started with (it raised its own): a
        // lower soft limit is always allowed, and no descriptor above it is
        // open any more
        if let Some(r) = &a.nofile {
            libc::setrlimit(libc::RLIMIT_NOFILE, r);
        }
        if libc::chdir(a.cwd) != 0 {
            fail(a);
        }
        // as execvp: the next candidate on "not here"; EACCES remembered
        let mut denied = false;
        for &path in &a.candidates {
            libc::execve(path, a.argv.as_ptr(), a.envp.as_ptr());
            match *libc::__errno_location() {
                libc::EACCES => denied = true,
                libc::ENOENT | libc::ENOTDIR | libc::ESTALE | libc::ENODEV | libc::ETIMEDOUT => {}
                _ => fail(a),
            }
        }
        if denied {
            *libc::__errno_location() = libc::EACCES;
        }
        fail(a)
    }
}
