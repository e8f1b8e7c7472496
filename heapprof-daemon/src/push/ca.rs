//! `--push-ca-file`: the certificates of a private CA that the pushes trust besides
//! the system's roots, read and checked at start-up so that a wrong file is one line
//! before anything is traced.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use super::{error_text::chain, target::TargetError};

/// A checked PEM file of one or more CA certificates.
#[derive(Debug, Clone)]
pub struct CaFile {
    path: PathBuf,
    /// The file's bytes, as tonic takes them.
    pem: Arc<Vec<u8>>,
}

impl CaFile {
    /// Reads `path` and checks that it holds at least one certificate and that each
    /// parses as a trust anchor.
    pub fn read(path: &Path) -> Result<Self, TargetError> {
        let bad = |what: String| TargetError::BadCaFile {
            path: path.to_owned(),
            what,
        };
        let pem = std::fs::read(path).map_err(|err| bad(err.to_string()))?;
        let certificates =
            reqwest::Certificate::from_pem_bundle(&pem).map_err(|err| bad(chain(&err)))?;
        if certificates.is_empty() {
            return Err(bad(
                "it holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into(),
            ));
        }
        // A client trusting only these parses each into a trust anchor: a block that
        // is PEM but no certificate fails here, not at the first push.
        let mut check = reqwest::Client::builder().tls_built_in_root_certs(false);
        for certificate in certificates {
            check = check.add_root_certificate(certificate);
        }
        check.build().map_err(|err| bad(chain(&err)))?;
        Ok(CaFile {
            path: path.to_owned(),
            pem: Arc::new(pem),
        })
    }

    /// The file, for log lines.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its certificates for reqwest (checked at start, so none is left out).
    pub fn reqwest_certificates(&self) -> Vec<reqwest::Certificate> {
        reqwest::Certificate::from_pem_bundle(&self.pem).unwrap_or_default()
    }

    /// Its certificates for tonic (which parses the bundle itself).
    pub fn tonic_certificate(&self) -> tonic::transport::Certificate {
        tonic::transport::Certificate::from_pem(self.pem.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_without_a_certificate_are_named_with_the_fix() {
        let dir = std::env::temp_dir().join(format!("heapprofd-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let file = dir.join("ca.pem");
        std::fs::write(&file, "not a certificate\n").expect("write");
        let err = CaFile::read(&file).expect_err("no certificate").to_string();
        assert!(err.contains("holds no PEM certificate"), "{err}");
        assert!(err.contains("--push-ca-file"), "{err}");
        std::fs::write(
            &file,
            "-----BEGIN CERTIFICATE-----\naGVsbG8gd29ybGQ=\n-----END CERTIFICATE-----\n",
        )
        .expect("write");
        let err = CaFile::read(&file)
            .expect_err("not a certificate")
            .to_string();
        assert!(err.contains("--push-ca-file"), "{err}");
        let missing = CaFile::read(&dir.join("missing")).expect_err("missing");
        assert!(missing.to_string().contains("No such file"), "{missing}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
