//! Finding the server binaries, and failing loudly when one is missing.
//!
//! A missing binary is a broken environment, never a reason to skip: a skipped
//! integration test is a silent green. So a failed lookup names the Debian
//! package that provides the binary and points at `scripts/ensure-deps`, which
//! installs every test dependency.

use std::ffi::OsStr;
use std::fmt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// A program the testkit runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binary {
    /// `etcd`, the etcd server.
    Etcd,
    /// `redis-server`.
    RedisServer,
    /// `redis-cli`, which joins Redis Cluster nodes into a cluster.
    RedisCli,
    /// `chromium`, the browser the console's tests drive.
    Chromium,
    /// `chromedriver`, Chromium's WebDriver server.
    ChromeDriver,
    /// `nginx`, the second gateway the end-to-end tests put in front of an application.
    Nginx,
    /// `openapi-spec-validator` (PyPI), which checks the services' OpenAPI documents.
    OpenapiSpecValidator,
    /// `schemathesis` (PyPI), which tests running services against their OpenAPI documents.
    Schemathesis,
    /// `npm`, which builds and tests the TypeScript client (Node.js 20 or later).
    Npm,
    /// `python3`, which tests the Python client with pytest.
    Python,
}

impl Binary {
    /// The program's file name, as looked up on `PATH`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Etcd => "etcd",
            Self::RedisServer => "redis-server",
            Self::RedisCli => "redis-cli",
            Self::Chromium => "chromium",
            Self::ChromeDriver => "chromedriver",
            Self::Nginx => "nginx",
            Self::OpenapiSpecValidator => "openapi-spec-validator",
            Self::Schemathesis => "schemathesis",
            Self::Npm => "npm",
            Self::Python => "python3",
        }
    }

    /// How to install the program: a Debian package or a PyPI one.
    #[must_use]
    pub fn install_hint(self) -> String {
        match self {
            Self::OpenapiSpecValidator | Self::Schemathesis => {
                format!("the PyPI package `{0}` (`pip install {0}`)", self.name())
            }
            _ => format!(
                "the Debian package `{0}` (`apt-get install {0}`)",
                self.debian_package()
            ),
        }
    }

    /// The Debian package that installs the program.
    #[must_use]
    pub fn debian_package(self) -> &'static str {
        match self {
            Self::Etcd => "etcd-server",
            Self::RedisServer | Self::RedisCli => "redis-server",
            Self::Chromium => "chromium",
            Self::ChromeDriver => "chromium-driver",
            Self::Nginx => "nginx",
            Self::OpenapiSpecValidator | Self::Schemathesis => "python3-pip",
            Self::Npm => "npm",
            Self::Python => "python3",
        }
    }

    /// The environment variable that, when set and non-empty, is the path of the
    /// program to run instead of looking it up on `PATH`.
    #[must_use]
    pub fn override_var(self) -> &'static str {
        match self {
            Self::Etcd => "ALLOT_ETCD_BIN",
            Self::RedisServer => "ALLOT_REDIS_SERVER_BIN",
            Self::RedisCli => "ALLOT_REDIS_CLI_BIN",
            Self::Chromium => "ALLOT_CHROMIUM_BIN",
            Self::ChromeDriver => "ALLOT_CHROMEDRIVER_BIN",
            Self::Nginx => "ALLOT_NGINX_BIN",
            Self::OpenapiSpecValidator => "ALLOT_OPENAPI_SPEC_VALIDATOR_BIN",
            Self::Schemathesis => "ALLOT_SCHEMATHESIS_BIN",
            Self::Npm => "ALLOT_NPM_BIN",
            Self::Python => "ALLOT_PYTHON_BIN",
        }
    }

    /// Finds the program from this process's environment: the override variable
    /// if set, else `PATH` and then the system dirs Debian puts daemons in
    /// (`/usr/sbin`, `/sbin`), which a non-root `PATH` may lack.
    ///
    /// # Errors
    /// [`MissingBinary`] when there is no executable file there; its message says
    /// what to install.
    pub fn locate(self) -> Result<PathBuf, MissingBinary> {
        let override_path = std::env::var_os(self.override_var());
        let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
            .map(|path| std::env::split_paths(&path).collect())
            .unwrap_or_default();
        dirs.extend(["/usr/sbin", "/sbin"].map(PathBuf::from));
        let search_path = std::env::join_paths(dirs).ok();
        self.locate_in(override_path.as_deref(), search_path.as_deref())
    }

    /// [`Binary::locate`] with the environment passed in, so the lookup can be
    /// tested without mutating the (process-global) environment.
    ///
    /// `override_path` is the value of [`Binary::override_var`]; an empty one
    /// counts as unset. `search_path` is a `PATH`-style list of directories.
    ///
    /// # Errors
    /// [`MissingBinary`] when the override is not an executable file, or when no
    /// directory of `search_path` holds an executable of this name.
    pub fn locate_in(
        self,
        override_path: Option<&OsStr>,
        search_path: Option<&OsStr>,
    ) -> Result<PathBuf, MissingBinary> {
        if let Some(path) = override_path.filter(|p| !p.is_empty()) {
            let path = PathBuf::from(path);
            return if is_executable_file(&path) {
                Ok(path)
            } else {
                Err(MissingBinary {
                    binary: self,
                    looked_in: format!(
                        "{}={} is not an executable file",
                        self.override_var(),
                        path.display()
                    ),
                })
            };
        }
        let search_path = search_path.unwrap_or_default();
        std::env::split_paths(search_path)
            .map(|dir| dir.join(self.name()))
            .find(|candidate| is_executable_file(candidate))
            .ok_or_else(|| MissingBinary {
                binary: self,
                looked_in: format!(
                    "not on PATH ({}) and {} is unset",
                    search_path.to_string_lossy(),
                    self.override_var()
                ),
            })
    }

    /// [`Binary::locate`], panicking with the install hint: what server start-up
    /// calls before spawning anything.
    #[must_use]
    pub fn require(self) -> PathBuf {
        self.locate().unwrap_or_else(|missing| panic!("{missing}"))
    }
}

fn is_executable_file(path: &Path) -> bool {
    path.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// A program the tests need is not installed (or its override points nowhere).
///
/// Its [`Display`](fmt::Display) names the Debian package to install and
/// `scripts/ensure-deps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingBinary {
    binary: Binary,
    looked_in: String,
}

impl MissingBinary {
    /// The program that was not found.
    #[must_use]
    pub fn binary(&self) -> Binary {
        self.binary
    }
}

impl fmt::Display for MissingBinary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "allot-testkit: `{name}` not found: {looked_in}. Install {hint}; \
             `scripts/ensure-deps` installs every test dependency. Integration tests never \
             skip when a server is missing.",
            name = self.binary.name(),
            looked_in = self.looked_in,
            hint = self.binary.install_hint(),
        )
    }
}

impl std::error::Error for MissingBinary {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    #[test]
    fn finds_an_executable_on_the_search_path() {
        let dir = tempfile::tempdir().expect("temp dir");
        let exe = dir.path().join("redis-cli");
        std::fs::write(&exe, "#!/bin/sh\n").expect("write fake binary");
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let path = std::env::join_paths(["/nonexistent-dir", dir.path().to_str().expect("utf-8")])
            .expect("join paths");

        let found = Binary::RedisCli.locate_in(None, Some(&path));

        assert_eq!(found, Ok(exe));
    }

    #[test]
    fn skips_files_that_are_not_executable() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("etcd"), "not a program").expect("write file");
        let path = OsString::from(dir.path());

        let missing = Binary::Etcd
            .locate_in(None, Some(&path))
            .expect_err("a non-executable file is not the binary");

        assert_eq!(missing.binary(), Binary::Etcd);
    }

    #[test]
    fn a_missing_override_names_the_variable_and_the_package() {
        let missing = Binary::RedisServer
            .locate_in(
                Some(OsStr::new("/nonexistent/redis-server")),
                Some(OsStr::new("/usr/bin")),
            )
            .expect_err("the override points nowhere");

        let message = missing.to_string();
        assert!(
            message.contains("ALLOT_REDIS_SERVER_BIN=/nonexistent/redis-server"),
            "{message}"
        );
        assert!(message.contains("`redis-server`"), "{message}");
        assert!(message.contains("scripts/ensure-deps"), "{message}");
    }

    #[test]
    fn an_empty_override_counts_as_unset() {
        let missing = Binary::Etcd
            .locate_in(Some(OsStr::new("")), Some(OsStr::new("/nonexistent-dir")))
            .expect_err("etcd is not in /nonexistent-dir");

        assert!(missing.to_string().contains("not on PATH"), "{missing}");
        assert!(missing.to_string().contains("etcd-server"), "{missing}");
    }
}
