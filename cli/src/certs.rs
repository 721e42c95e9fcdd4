//! `pdbridge certs`: a small private CA and one certificate per daemon.
//!
//! Each certificate names one identity (a DNS-style name such as `prefill-1`
//! or `mac-1`) in its subjectAltName and is good both for serving and for
//! dialing, since every daemon does both. Run again with the same `--out` to
//! add boxes or renew certificates: the CA found there is reused, so the
//! certificates already deployed stay valid.

use std::{
    io::Write,
    os::unix::fs::{DirBuilderExt, OpenOptionsExt},
    path::{Path, PathBuf},
    process::ExitCode,
};

use clap::Args;
use pdbridge_common::tls::is_identity;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use time::{Duration, OffsetDateTime};

#[derive(Debug, Args)]
pub struct CertsArgs {
    /// Directory for `ca.pem`, `ca.key` and `<name>.pem` / `<name>.key` (created 0700; files 0600).
    #[arg(long, default_value = "deploy/certs")]
    out: PathBuf,
    /// Days each daemon certificate is valid.
    #[arg(long, default_value_t = 397)]
    days: i64,
    /// One identity per daemon, e.g. `prefill-1 mac-1` (letters, digits, hyphens, dots).
    #[arg(required = true, value_name = "NAME")]
    names: Vec<String>,
}

/// Days a new CA is valid.
const CA_DAYS: i64 = 3650;

pub fn run(args: &CertsArgs) -> ExitCode {
    match issue(args) {
        Ok(written) => {
            for line in written {
                println!("{line}");
            }
            ExitCode::SUCCESS
        }
        Err(problem) => {
            eprintln!("pdbridge certs: {problem}");
            ExitCode::FAILURE
        }
    }
}

fn issue(args: &CertsArgs) -> Result<Vec<String>, String> {
    if let Some(bad) = args.names.iter().find(|name| !is_identity(name) || *name == "ca") {
        return Err(format!("{bad:?} is not a usable identity (a DNS-style name other than `ca`)"));
    }
    if !(1..=3650).contains(&args.days) {
        return Err("--days must be between 1 and 3650".into());
    }
    create_private_dir(&args.out)?;
    let mut written = Vec::new();
    let (ca_pem, ca_key) = match (read(&args.out.join("ca.pem")), read(&args.out.join("ca.key"))) {
        (Some(pem), Some(key)) => {
            written.push(format!("reusing the CA in {}", args.out.display()));
            (pem, KeyPair::from_pem(&key).map_err(|e| format!("ca.key: {e}"))?)
        }
        (None, None) => {
            let (pem, key) = new_ca()?;
            write_private(&args.out.join("ca.key"), key.serialize_pem().as_bytes())?;
            write_private(&args.out.join("ca.pem"), pem.as_bytes())?;
            written.push(format!("{}: a new CA, valid {CA_DAYS} days", args.out.join("ca.pem").display()));
            (pem, key)
        }
        _ => return Err(format!("{} has only one of ca.pem and ca.key", args.out.display())),
    };
    let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key).map_err(|e| format!("ca.pem: {e}"))?;
    for name in &args.names {
        let (pem, key) = leaf(name, args.days, &issuer)?;
        write_private(&args.out.join(format!("{name}.key")), key.serialize_pem().as_bytes())?;
        write_private(&args.out.join(format!("{name}.pem")), pem.as_bytes())?;
        written.push(format!("{}: {name}, valid {} days", args.out.join(format!("{name}.pem")).display(), args.days));
    }
    Ok(written)
}

fn new_ca() -> Result<(String, KeyPair), String> {
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(|e| e.to_string())?;
    params.distinguished_name.push(DnType::CommonName, "pd-bridge CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    (params.not_before, params.not_after) = validity(CA_DAYS);
    let key = KeyPair::generate().map_err(|e| e.to_string())?;
    let cert = params.self_signed(&key).map_err(|e| e.to_string())?;
    Ok((cert.pem(), key))
}

fn leaf(name: &str, days: i64, issuer: &Issuer<'_, KeyPair>) -> Result<(String, KeyPair), String> {
    let mut params = CertificateParams::new(vec![name.to_owned()]).map_err(|e| e.to_string())?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    (params.not_before, params.not_after) = validity(days);
    let key = KeyPair::generate().map_err(|e| e.to_string())?;
    let cert = params.signed_by(&key, issuer).map_err(|e| e.to_string())?;
    Ok((cert.pem(), key))
}

/// From an hour ago (clocks differ a little between boxes) for `days`.
fn validity(days: i64) -> (OffsetDateTime, OffsetDateTime) {
    let now = OffsetDateTime::now_utc();
    (now - Duration::hours(1), now + Duration::days(days))
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

fn create_private_dir(dir: &Path) -> Result<(), String> {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(|e| format!("{}: {e}", dir.display()))
}

/// Writes `bytes` to `path` with mode 0600, replacing it atomically (a
/// renewal never leaves a half-written key where a daemon reads it).
fn write_private(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let tmp = path.with_extension("tmp");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    file.write_all(bytes).and_then(|()| file.sync_all()).map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use pdbridge_common::tls::{first_pem_der, identities};

    use super::*;

    #[test]
    fn issues_a_ca_and_identities_then_reuses_the_ca() {
        let out = std::env::temp_dir().join(format!("pdb-certs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let args = |names: &[&str]| CertsArgs {
            out: out.clone(),
            days: 30,
            names: names.iter().map(|n| n.to_string()).collect(),
        };
        issue(&args(&["prefill-1", "mac-1"])).unwrap();
        let ca = std::fs::read(out.join("ca.pem")).unwrap();
        for file in ["ca.pem", "ca.key", "prefill-1.pem", "prefill-1.key", "mac-1.pem", "mac-1.key"] {
            let mode = std::fs::metadata(out.join(file)).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{file}");
        }
        let der = first_pem_der(&std::fs::read(out.join("mac-1.pem")).unwrap()).unwrap();
        assert_eq!(identities(&der).unwrap(), ["mac-1"]);

        let again = issue(&args(&["mac-2"])).unwrap();
        assert!(again[0].starts_with("reusing the CA"), "{again:?}");
        assert_eq!(std::fs::read(out.join("ca.pem")).unwrap(), ca, "the CA is kept");
        assert!(issue(&args(&["../etc"])).is_err());
        assert!(issue(&args(&["ca"])).is_err());
        std::fs::remove_dir_all(&out).unwrap();
    }
}
