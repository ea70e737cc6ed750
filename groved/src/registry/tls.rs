//! The TLS client configuration for registry pulls: the system's roots plus `ca_files`.

use std::sync::{Arc, Mutex};

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::CertificateDer;
use rustls::{ClientConfig, RootCertStore};

use super::RegistriesConfig;

/// The client config for `cfg`, built once per set of `ca_files` (the system's roots are read
/// from disk, ~150 files, so not on every pull).
pub(super) fn client_config(cfg: &RegistriesConfig) -> Result<Arc<ClientConfig>, String> {
    static BUILT: Mutex<Option<(Vec<std::path::PathBuf>, Arc<ClientConfig>)>> = Mutex::new(None);
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((files, c)) = built.as_ref() {
        if *files == cfg.ca_files {
            return Ok(c.clone());
        }
    }
    let mut roots = RootCertStore::empty();
    // Unreadable system certificates are skipped, as every TLS client does; the ones that load
    // are what the node trusts.
    roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    for f in &cfg.ca_files {
        let certs = CertificateDer::pem_file_iter(f)
            .and_then(|it| it.collect::<Result<Vec<_>, _>>())
            .map_err(|e| format!("registries.ca_files: {}: {e}", f.display()))?;
        if certs.is_empty() {
            return Err(format!(
                "registries.ca_files: {}: no PEM certificate in it",
                f.display()
            ));
        }
        for c in certs {
            roots
                .add(c)
                .map_err(|e| format!("registries.ca_files: {}: {e}", f.display()))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let c = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS set-up: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let c = Arc::new(c);
    *built = Some((cfg.ca_files.clone(), c.clone()));
    Ok(c)
}

/// The TLS failure behind a failed request, if that is what failed it: the certificate or the
/// handshake, as opposed to a registry that is down.
pub(super) fn failure(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cur = Some(e);
    while let Some(e) = cur {
        if let Some(t) = e.downcast_ref::<rustls::Error>() {
            return Some(t.to_string());
        }
        // An io::Error's `source()` skips the error it wraps; `get_ref()` is that error.
        cur = match e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => e.source(),
        };
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ca_file_that_is_not_pem_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("ca.pem");
        std::fs::write(&f, "not a certificate\n").unwrap();
        let cfg = RegistriesConfig {
            ca_files: vec![f.clone()],
            ..Default::default()
        };
        let e = client_config(&cfg).unwrap_err();
        assert!(
            e.contains("ca.pem") && e.contains("no PEM certificate"),
            "{e}"
        );
        let missing = RegistriesConfig {
            ca_files: vec![dir.path().join("absent.pem")],
            ..Default::default()
        };
        assert!(client_config(&missing).unwrap_err().contains("absent.pem"));
        assert!(client_config(&RegistriesConfig::default()).is_ok());
    }
}
