//! How a CRIU binary is started. scripts/setup installs Debian 13's CRIU into a private prefix
//! with a shell wrapper that runs it under that prefix's loader and libc; the wrapper costs a
//! shell, `readlink` and `dirname` (about 6 ms of a CRIU run's 11 here, in every dump while the
//! sandbox is frozen and in every branch's restore). Where the binary is that wrapper, CRIU is
//! started the way its last line does it, without the shell.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The private prefix's layout beside its wrapper (scripts/setup, "CRIU from Debian 13").
const PREFIX: &str = "root";
const LOADER: &str = "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2";
const LIBS: &str = "usr/lib/x86_64-linux-gnu";
const CRIU: &str = "usr/sbin/criu";
/// The host's own library dirs, after the prefix's (the wrapper's `--library-path`).
const HOST_LIBS: &str = "/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu";

/// The program to execute and the arguments that come before CRIU's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    program: PathBuf,
    leading: Vec<OsString>,
}

impl Launch {
    /// `binary` itself, or, where it is the wrapper of a private prefix (the prefix's loader
    /// and CRIU both sit beside it), the loader with the wrapper's arguments.
    pub fn of(binary: &Path) -> Launch {
        let direct = Launch {
            program: binary.to_path_buf(),
            leading: Vec::new(),
        };
        let Ok(real) = binary.canonicalize() else {
            return direct;
        };
        let Some(root) = real.parent().map(|d| d.join(PREFIX)) else {
            return direct;
        };
        let (loader, criu) = (root.join(LOADER), root.join(CRIU));
        if !loader.is_file() || !criu.is_file() {
            return direct;
        }
        let mut libs = root.join(LIBS).into_os_string();
        libs.push(":");
        libs.push(HOST_LIBS);
        Launch {
            program: loader,
            leading: vec!["--library-path".into(), libs, criu.into_os_string()],
        }
    }

    /// A command that runs CRIU; CRIU's arguments follow.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.leading);
        cmd
    }

    /// The program and leading arguments, for a shell's `"$@"`.
    pub fn argv(&self) -> impl Iterator<Item = &std::ffi::OsStr> {
        std::iter::once(self.program.as_os_str()).chain(self.leading.iter().map(|a| a.as_os_str()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_private_prefix_wrapper_is_skipped_and_anything_else_run_as_given() {
        let dir = tempfile::tempdir().unwrap();
        let wrapper = dir.path().join("criu");
        std::fs::write(&wrapper, "#!/bin/sh\n").unwrap();
        assert_eq!(
            Launch::of(&wrapper).argv().count(),
            1,
            "no prefix: as given"
        );
        let root = dir.path().join(PREFIX);
        for f in [LOADER, CRIU] {
            std::fs::create_dir_all(root.join(f).parent().unwrap()).unwrap();
            std::fs::write(root.join(f), "").unwrap();
        }
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&wrapper, &link).unwrap();
        let real_root = root.canonicalize().unwrap();
        let want: Vec<OsString> = vec![
            real_root.join(LOADER).into(),
            "--library-path".into(),
            format!("{}:{HOST_LIBS}", real_root.join(LIBS).display()).into(),
            real_root.join(CRIU).into(),
        ];
        for via in [&wrapper, &link] {
            let got: Vec<OsString> = Launch::of(via).argv().map(Into::into).collect();
            assert_eq!(got, want, "{}", via.display());
        }
        assert_eq!(Launch::of(Path::new("/nonexistent/criu")).argv().count(), 1);
    }

    /// Where scripts/setup installed its prefix, the direct start runs the same CRIU.
    #[test]
    fn the_installed_prefix_starts_without_its_wrapper() {
        let wrapper = Path::new(super::super::DEFAULT_BINARY);
        let launch = Launch::of(wrapper);
        if launch.argv().count() == 1 {
            grove_testkit::capability_missing("no private CRIU prefix at the default place");
            return;
        }
        let version = |mut c: Command| {
            let out = c.arg("--version").output().unwrap();
            assert!(out.status.success());
            String::from_utf8(out.stdout).unwrap()
        };
        let direct = version(launch.command());
        assert!(direct.starts_with("Version: "), "{direct}");
        assert_eq!(direct, version(Command::new(wrapper)));
    }
}
