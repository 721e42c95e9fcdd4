//! More hosts on this machine: a network namespace joined to the test's own by
//! a veth pair, so that a process in it reaches the test's processes only
//! through that pair's addresses, as another box on the LAN would. Made by the
//! test, torn down on drop. Needs what `ip netns add` needs (root, or
//! CAP_SYS_ADMIN and CAP_NET_ADMIN).

use std::{net::Ipv4Addr, process::Command as StdCommand};

use tokio::process::Command;

/// Another host: its namespace, its address, and ours on the link between us.
pub struct Host {
    pub namespace: String,
    /// This host's address, in its namespace.
    pub addr: Ipv4Addr,
    /// Its interface, in its namespace.
    pub iface: String,
    /// The test's own address on the link.
    pub local_addr: Ipv4Addr,
    /// The test's own end of the link.
    pub local_iface: String,
}

fn ip(args: &[&str]) {
    let output = StdCommand::new("ip").args(args).output().unwrap_or_else(|e| panic!("run ip {args:?}: {e}"));
    assert!(
        output.status.success(),
        "ip {}: {} (a test host needs root, or CAP_SYS_ADMIN and CAP_NET_ADMIN)",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr).trim()
    );
}

impl Host {
    /// A new host on its own /24 (10.231.N.0, N from this process's id).
    pub fn create(tag: &str) -> Host {
        let id = std::process::id();
        let subnet = 1 + id % 250;
        let namespace = format!("pdb-{tag}-{id}");
        let (iface, local_iface) = (format!("pdb{}b", id % 100_000), format!("pdb{}a", id % 100_000));
        let host = Host {
            addr: Ipv4Addr::new(10, 231, subnet as u8, 2),
            local_addr: Ipv4Addr::new(10, 231, subnet as u8, 1),
            namespace,
            iface,
            local_iface,
        };
        host.remove(); // what a killed run left
        let (ns, ours, theirs) = (host.namespace.as_str(), host.local_iface.as_str(), host.iface.as_str());
        ip(&["netns", "add", ns]);
        ip(&["link", "add", ours, "type", "veth", "peer", "name", theirs]);
        ip(&["link", "set", theirs, "netns", ns]);
        ip(&["addr", "add", &format!("{}/24", host.local_addr), "dev", ours]);
        ip(&["link", "set", ours, "up"]);
        ip(&["-n", ns, "addr", "add", &format!("{}/24", host.addr), "dev", theirs]);
        ip(&["-n", ns, "link", "set", theirs, "up"]);
        ip(&["-n", ns, "link", "set", "lo", "up"]);
        host
    }

    /// `program` run on this host.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.namespace]).arg(program);
        command
    }

    fn remove(&self) {
        // Deleting our end deletes the pair; the namespace's processes are the test's to stop.
        let _ = StdCommand::new("ip").args(["link", "del", &self.local_iface]).output();
        let _ = StdCommand::new("ip").args(["netns", "del", &self.namespace]).output();
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.remove();
    }
}
