//! File descriptors from another process, for CUDA IPC of VMM memory.
//!
//! A physical allocation made by `cuMemCreate` is exported as a POSIX file descriptor
//! ([`Device::export_handle`](crate::Device::export_handle)); the descriptor number means nothing in
//! another process, which takes its own copy with `pidfd_open(pid)` + `pidfd_getfd(pidfd, fd)` (Linux
//! 5.6+), as PyTorch's expandable segments do (`ExpandableSegment::fromShared`). The sender must still
//! be alive and the receiver allowed to trace it (the kernel checks `PTRACE_MODE_ATTACH_REALCREDS`:
//! same user, and under Yama's `ptrace_scope` 1 only an ancestor may, so a child cannot take its
//! parent's descriptors; 0 allows any process of the same user).

use std::os::fd::{FromRawFd, OwnedFd};

use crate::{DeviceError, Result};

/// The calling thread's `errno`.
fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn os_error(call: &'static str, errno: i32) -> DeviceError {
    let why = std::io::Error::from_raw_os_error(errno);
    let message = match errno {
        libc::ENOSYS => format!("{why}: the kernel is older than Linux 5.6 (no pidfd_getfd)"),
        libc::EPERM => format!(
            "{why}: this process may not take file descriptors of the sender (the kernel's \
             ptrace check: run both as the same user; with /proc/sys/kernel/yama/ptrace_scope = 1 \
             only an ancestor of the sender may, so set it to 0 or send from the child)"
        ),
        libc::ESRCH => format!("{why}: the sending process has exited"),
        libc::EBADF => format!("{why}: the sender no longer holds that descriptor"),
        _ => why.to_string(),
    };
    DeviceError::Os {
        call,
        errno,
        message,
    }
}

/// Another process's file descriptors, through a pidfd of it.
#[derive(Debug)]
pub struct ProcessFds {
    pidfd: OwnedFd,
}

impl ProcessFds {
    /// A handle on process `pid` (`pidfd_open`).
    pub fn open(pid: i32) -> Result<Self> {
        if pid <= 0 {
            return Err(DeviceError::InvalidArgument {
                call: "pidfd_open",
                detail: format!("invalid process id {pid}"),
            });
        }
        // SAFETY: pidfd_open takes a pid and flags, no pointers; it returns a new descriptor or -1.
        let r = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if r < 0 {
            return Err(os_error("pidfd_open", errno()));
        }
        // SAFETY: `r` is a descriptor the kernel just opened for us and nothing else owns.
        let pidfd = unsafe { OwnedFd::from_raw_fd(r as i32) };
        Ok(ProcessFds { pidfd })
    }

    /// This process's own copy of the process's descriptor `fd` (`pidfd_getfd`).
    pub fn take(&self, fd: i32) -> Result<OwnedFd> {
        use std::os::fd::AsRawFd;
        if fd < 0 {
            return Err(DeviceError::InvalidArgument {
                call: "pidfd_getfd",
                detail: format!("invalid file descriptor {fd}"),
            });
        }
        // SAFETY: pidfd_getfd takes two descriptors and flags, no pointers; it returns a new descriptor
        // or -1. The pidfd is live (owned by `self`).
        let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, self.pidfd.as_raw_fd(), fd, 0) };
        if r < 0 {
            return Err(os_error("pidfd_getfd", errno()));
        }
        // SAFETY: `r` is a descriptor the kernel just opened for us and nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(r as i32) })
    }
}

/// This process's id.
pub fn this_process() -> i32 {
    std::process::id() as i32
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsRawFd;

    #[test]
    fn a_descriptor_taken_through_a_pidfd_is_the_same_file() {
        let mut f = std::fs::File::from(memfd());
        f.write_all(b"genpool ipc").unwrap();
        let fds = ProcessFds::open(this_process()).unwrap();
        let copy = fds.take(f.as_raw_fd()).unwrap();
        assert_ne!(copy.as_raw_fd(), f.as_raw_fd(), "a new descriptor");
        let mut g = std::fs::File::from(copy);
        g.rewind().unwrap();
        let mut s = String::new();
        g.read_to_string(&mut s).unwrap();
        assert_eq!(
            s, "genpool ipc",
            "same open file: the bytes written through the original"
        );
    }

    #[test]
    fn bad_pids_and_descriptors_are_typed_errors() {
        assert!(matches!(
            ProcessFds::open(0),
            Err(DeviceError::InvalidArgument { .. })
        ));
        let fds = ProcessFds::open(this_process()).unwrap();
        assert!(matches!(
            fds.take(-1),
            Err(DeviceError::InvalidArgument { .. })
        ));
        // A descriptor number this process does not hold.
        match fds.take(1 << 20) {
            Err(DeviceError::Os { call, errno, .. }) => {
                assert_eq!(call, "pidfd_getfd");
                assert_eq!(errno, libc::EBADF);
            }
            other => panic!("expected EBADF, got {other:?}"),
        }
        // A process that does not exist (pid_max is at most 2^22).
        match ProcessFds::open(1 << 23) {
            Err(DeviceError::Os { call, errno, .. }) => {
                assert_eq!(call, "pidfd_open");
                assert!(
                    errno == libc::ESRCH || errno == libc::EINVAL,
                    "errno {errno}"
                );
            }
            other => panic!("expected ESRCH, got {other:?}"),
        }
    }

    fn memfd() -> OwnedFd {
        crate::sim::memfd("gen-device-test").unwrap()
    }
}
