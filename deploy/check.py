#!/usr/bin/env python3
"""Validates the deployment files under deploy/ (for the test suite, and before shipping a change).

  systemd/*.service  systemd-analyze verify on a copy whose ExecStart points at a stub binary
                     (verify needs an executable; the real path is checked separately), with
                     --recursive-errors=no so unknown directives and unparsable values FAIL
                     (plain verify only warns and exits 0); systemd-analyze security --offline
                     as a hardening regression guard; then the settings this project relies on
                     (Type=notify, user, timeouts vs the example configs, hardening, no reload).
  examples/*.toml    secure by default: mutual TLS with peers, https dials, not insecure.
  launchd/*.plist    parses as a property list; required keys with the right types and values;
                     no key launchd does not know (launchd silently ignores a misspelt key).
  grafana/*.json     valid JSON; importable shape; every panel has a target with an expr; only
                     the daemons' metric and label names; brackets and quotes balance.
  prometheus/*.yml   YAML (PyYAML if available, else a structural check): both jobs, ports,
                     metrics_path, role labels, interval; promtool check config; rules.yml by
                     promtool check rules and its unit tests (rules.test.yml) by promtool test
                     rules; every alert has a runbook line in deploy/README.md.

Usage: deploy/check.sh (or python3 deploy/check.py): exit 0 when everything passes, 1 with FAIL
lines on stderr otherwise. Needs Python >= 3.11, systemd-analyze (Debian: apt-get install -y
systemd) and promtool (scripts/setup-prometheus.sh puts it under var/prometheus/; PROMTOOL= names
another). Without systemd-analyze it fails unless PDB_DEPLOY_CHECK_NO_SYSTEMD=1 (e.g. on macOS),
which skips only that step.
"""

import json, os, re, subprocess, sys, shutil, plistlib, tempfile, traceback

deploy = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(deploy)
failures = 0

def fail(msg):
    global failures
    failures += 1
    print(f"FAIL: {msg}", file=sys.stderr)

def ok(msg):
    print(f"ok:   {msg}")

def rel(p):
    return os.path.relpath(p, root)

def report(path, problems, summary):
    """One FAIL line per problem with `path`, or one ok line with `summary`."""
    for p in problems:
        fail(f"{rel(path)}: {p}")
    if not problems:
        ok(f"{rel(path)}: {summary}")


# --- systemd: what systemd itself says ------------------------------------------------------
def systemd_analyze(tmp):
    """systemd-analyze verify and security on a copy of each unit under `tmp`."""
    if not shutil.which("systemd-analyze"):
        if os.environ.get("PDB_DEPLOY_CHECK_NO_SYSTEMD") == "1":
            print("SKIP: systemd-analyze not found; unit files get the static checks only "
                  "(PDB_DEPLOY_CHECK_NO_SYSTEMD=1)")
        else:
            fail("systemd-analyze not found: install it (Debian: apt-get install -y systemd) "
                 "or set PDB_DEPLOY_CHECK_NO_SYSTEMD=1")
        return
    bin_dir, units_dir = os.path.join(tmp, "bin"), os.path.join(tmp, "units")
    os.makedirs(bin_dir, exist_ok=True)
    os.makedirs(units_dir, exist_ok=True)
    help_text = subprocess.run(["systemd-analyze", "security", "--help"], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, errors="replace").stdout

    def analyze(*args):
        """(exit status as a shell gives it, output without trailing newlines), run in units_dir."""
        r = subprocess.run(["systemd-analyze", *args], cwd=units_dir, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, errors="replace")
        return (r.returncode if r.returncode >= 0 else 128 - r.returncode), r.stdout.rstrip("\n")

    for d in ("prefilld", "decoded"):
        unit = f"pdbridge-{d}.service"
        src = os.path.join(deploy, "systemd", unit)
        if not os.path.isfile(src):
            fail(f"deploy/systemd/{unit}: missing")
            continue
        # verify checks that ExecStart's binary exists and is executable; point it at a stub so the
        # check does not depend on an install or a build. The real ExecStart is checked below.
        stub = os.path.join(bin_dir, d)
        with open(stub, "w") as f:
            f.write("#!/bin/sh\nexit 0\n")
        os.chmod(stub, 0o755)
        with open(src, newline="") as f:
            text = f.read()
        text = re.sub(rf"^ExecStart=/usr/local/bin/{re.escape(d)}( |$)",
                      lambda m: f"ExecStart={stub}{m.group(1)}", text, flags=re.M)
        # Keep the unit's own name: verify derives the unit type and name from the file name.
        with open(os.path.join(units_dir, unit), "w", newline="") as f:
            f.write(text)
        if sum(line.startswith(f"ExecStart={stub}") for line in text.split("\n")) != 1:
            fail(f"deploy/systemd/{unit}: expected exactly one ExecStart=/usr/local/bin/{d} ...")
            continue
        status, out = analyze("verify", "--man=no", "--recursive-errors=no", f"./{unit}")
        # Any diagnostic about this unit (unknown key, bad value, missing binary) is a failure,
        # whatever the exit status; lines about the host's other units are shown, not judged.
        if status != 0 or any(unit in line for line in out.split("\n")):
            fail(f"deploy/systemd/{unit}: systemd-analyze verify (exit {status}):")
            for line in out.split("\n"):
                print("      " + line.replace(f"{units_dir}/", "deploy/systemd/", 1), file=sys.stderr)
        else:
            ok(f"{unit}: systemd-analyze verify is clean")
            if out:
                for line in out.split("\n"):
                    print(f"      note: {line}")
        # Hardening regression guard: exposure is 4.1 ("OK") today; 5.0 leaves room for a newer
        # systemd that scores more settings, but catches a dropped Protect*/capability line.
        if "--offline" in help_text:
            status, out = analyze("security", "--offline=true", "--threshold=50", "--no-pager", f"./{unit}")
            # "Overall exposure level for <unit>: 4.1 OK :-)" -> "4.1 OK"
            levels = [re.sub(r" [^ ]*$", "", re.sub(r".*: ", "", m.group(0), count=1), count=1)
                      for m in re.finditer(r"Overall exposure level for.*", out)]
            level = "\n".join(levels) or "?"
            if status != 0:
                fail(f"deploy/systemd/{unit}: systemd-analyze security: exposure {level} is above 5.0")
            else:
                ok(f"{unit}: systemd-analyze security exposure {level} (limit 5.0)")
        else:
            print("note: systemd-analyze security --offline unavailable (systemd < 250); exposure not checked")

# --- durations ------------------------------------------------------------------------------
SYSTEMD_UNITS = {"us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "s": 1, "sec": 1, "second": 1,
                 "seconds": 1, "m": 60, "min": 60, "minute": 60, "minutes": 60, "h": 3600, "hr": 3600,
                 "hour": 3600, "hours": 3600, "d": 86400, "day": 86400, "days": 86400}

def seconds(text):
    """A systemd time span ("900", "60s", "1min 30s") or a config duration ("30s", "5m")."""
    text = text.strip().strip('"')
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    total, pos = 0.0, 0
    for m in re.finditer(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)", text):
        if m.start() != pos or m.group(2) not in SYSTEMD_UNITS:
            raise ValueError(f"cannot parse duration {text!r}")
        total += float(m.group(1)) * SYSTEMD_UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text) or pos == 0:
        raise ValueError(f"cannot parse duration {text!r}")
    return total

def example_value(daemon, section, key):
    """A duration from deploy/examples/<daemon>.toml (what the unit's timeouts must exceed)."""
    path = os.path.join(deploy, "examples", f"{daemon}.toml")
    try:
        import tomllib
        with open(path, "rb") as f:
            node = tomllib.load(f)
        for part in section.split("."):
            node = node[part]
        return seconds(node[key])
    except ImportError:
        current = None
        for line in open(path):
            line = line.split("#", 1)[0].strip()
            if line.startswith("["):
                current = line.strip("[]")
            elif current == section and re.match(rf"{key}\s*=", line):
                return seconds(line.split("=", 1)[1])
        raise KeyError(f"{section}.{key} not in {path}")

# --- systemd units: the settings pd-bridge relies on ----------------------------------------
def parse_unit(path):
    sections, current = {}, None
    for n, raw in enumerate(open(path), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        if "=" not in line or current is None:
            raise ValueError(f"{rel(path)}:{n}: not a key=value line: {line!r}")
        k, v = line.split("=", 1)
        current.setdefault(k.strip(), []).append(v.strip())
    return sections

REQUIRED = {
    "Service": {
        "Type": "notify", "NotifyAccess": "main", "WorkingDirectory": "/var/lib/pd-bridge",
        "User": "pdbridge", "Group": "pdbridge", "Restart": "on-failure", "KillMode": "mixed",
        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
        "ProtectKernelTunables": "yes", "ProtectControlGroups": "yes", "RestrictSUIDSGID": "yes",
        "LockPersonality": "yes", "StateDirectory": "pd-bridge", "CacheDirectory": "pd-bridge",
        "LimitNOFILE": "65536", "RestartPreventExitStatus": "2",
    },
    "Install": {"WantedBy": "multi-user.target"},
}
# Why each is forbidden: see the units' "Not set on purpose" comments.
FORBIDDEN = {
    "ExecReload": "config reload is not supported",
    "MemoryDenyWriteExecute": "Python/torch/MLX JIT need W+X memory",
    "PrivateDevices": "hides /dev/nvidia*", "DevicePolicy": "hides /dev/nvidia*",
    "DeviceAllow": "turns on a device allow-list that hides /dev/nvidia*",
    "ProtectClock": "implies DeviceAllow=char-rtc, which hides /dev/nvidia*",
    "RemoveIPC": "would delete the other daemon's POSIX shm when both share the pdbridge user",
}
ENV = {"HF_HUB_OFFLINE": "1", "HOME": "/var/lib/pd-bridge", "XDG_CACHE_HOME": "/var/cache/pd-bridge",
       # Mutual TLS from systemd credentials (LoadCredential=, readable by this service only).
       "PDB_TLS__CERT": "%d/tls-cert", "PDB_TLS__KEY": "%d/tls-key", "PDB_TLS__CA": "%d/tls-ca"}
CREDENTIALS = {"tls-cert": "/etc/pd-bridge/certs/cert.pem", "tls-key": "/etc/pd-bridge/certs/key.pem",
               "tls-ca": "/etc/pd-bridge/certs/ca.pem"}

def check_units():
    for daemon in ("prefilld", "decoded"):
        path = os.path.join(deploy, "systemd", f"pdbridge-{daemon}.service")
        if not os.path.exists(path):
            fail(f"{rel(path)}: missing")
            continue
        try:
            unit = parse_unit(path)
        except ValueError as e:
            fail(str(e))
            continue
        problems = []
        svc = unit.get("Service", {})
        if not unit.get("Unit", {}).get("Description"):
            problems.append("[Unit] Description= is missing")
        for section, keys in REQUIRED.items():
            have = unit.get(section, {})
            for k, want in keys.items():
                if have.get(k, [None])[-1] != want:
                    problems.append(f"[{section}] {k}= should be {want!r}, is {have.get(k, [None])[-1]!r}")
        want_exec = f"/usr/local/bin/{daemon} --config /etc/pd-bridge/{daemon}.toml"
        if svc.get("ExecStart") != [want_exec]:
            problems.append(f"ExecStart= should be exactly {want_exec!r}, is {svc.get('ExecStart')!r}")
        for k, why in FORBIDDEN.items():
            if any(k in s for s in unit.values()):
                problems.append(f"{k}= must not be set: {why}")
        rw = " ".join(svc.get("ReadWritePaths", [])).split()
        for p in ("/var/lib/pd-bridge", "/var/cache/pd-bridge"):
            if p not in rw:
                problems.append(f"ReadWritePaths= lacks {p}")
        env = dict(kv.split("=", 1) for e in svc.get("Environment", []) for kv in e.split() if "=" in kv)
        for k, v in ENV.items():
            if env.get(k) != v:
                problems.append(f"Environment={k}={v} missing (have {env.get(k)!r})")
        creds = dict(c.split(":", 1) for c in svc.get("LoadCredential", []) if ":" in c)
        for name, source in CREDENTIALS.items():
            if creds.get(name) != source:
                problems.append(f"LoadCredential={name}:{source} missing (have {creds.get(name)!r})")
        if "RestartSec" not in svc:
            problems.append("RestartSec= missing")
        try:
            drain = example_value(daemon, "server", "drain_timeout")
            start = example_value(daemon, "engine", "start_timeout")
            stop_s = seconds(svc.get("TimeoutStopSec", ["0"])[-1])
            start_s = seconds(svc.get("TimeoutStartSec", ["0"])[-1])
            if not stop_s > drain:
                problems.append(f"TimeoutStopSec= ({stop_s:g}s) must exceed server.drain_timeout ({drain:g}s) "
                                f"in deploy/examples/{daemon}.toml, or systemd SIGKILLs a drain")
            if not start_s > start:
                problems.append(f"TimeoutStartSec= ({start_s:g}s) must exceed engine.start_timeout ({start:g}s) "
                                f"in deploy/examples/{daemon}.toml")
            if daemon == "prefilld" and start_s < 600:
                problems.append(f"TimeoutStartSec= ({start_s:g}s) is short for a vLLM cold start")
        except (ValueError, KeyError, OSError) as e:
            problems.append(f"timeouts: {e}")
        report(path, problems, f"notify/user/restart/timeouts/hardening/environment/TLS credentials as required")

# --- example configs: secure by default -----------------------------------------------------
DIALS = {"decoded": [("front", "prefilld")], "prefilld": [("decoders", "addr")]}

def check_examples():
    import tomllib
    for daemon in ("prefilld", "decoded"):
        path = os.path.join(deploy, "examples", f"{daemon}.toml")
        problems = []
        with open(path, "rb") as f:
            conf = tomllib.load(f)
        tls = conf.get("tls", {})
        for key in ("cert", "key", "ca", "peers"):
            if not tls.get(key):
                problems.append(f"[tls] {key} missing: the examples run mutual TLS")
        if conf.get("server", {}).get("insecure"):
            problems.append("server.insecure must not be set in an example")
        for section, key in DIALS[daemon]:
            entries = conf.get(section, [])
            for entry in entries if isinstance(entries, list) else [entries]:
                if not str(entry.get(key, "https://")).startswith("https://"):
                    problems.append(f"{section}.{key} = {entry.get(key)!r} is not https://")
        report(path, problems, f"mutual TLS with peers, https dials, not insecure")

# --- launchd plist --------------------------------------------------------------------------
LAUNCHD_KEYS = {
    "Label", "Disabled", "UserName", "GroupName", "inetdCompatibility", "LimitLoadToHosts",
    "LimitLoadFromHosts", "LimitLoadToSessionType", "LimitLoadToHardware", "LimitLoadFromHardware",
    "Program", "ProgramArguments", "EnableGlobbing", "EnableTransactions", "EnablePressuredExit",
    "OnDemand", "ServiceIPC", "KeepAlive", "RunAtLoad", "RootDirectory", "WorkingDirectory",
    "EnvironmentVariables", "Umask", "TimeOut", "ExitTimeOut", "ThrottleInterval", "InitGroups",
    "WatchPaths", "QueueDirectories", "StartOnMount", "StartInterval", "StartCalendarInterval",
    "StandardInPath", "StandardOutPath", "StandardErrorPath", "Debug", "WaitForDebugger",
    "SoftResourceLimits", "HardResourceLimits", "Nice", "ProcessType", "AbandonProcessGroup",
    "LowPriorityIO", "LowPriorityBackgroundIO", "MaterializeDatalessFiles", "LaunchOnlyOnce",
    "MachServices", "Sockets", "LaunchEvents", "SessionCreate", "AssociatedBundleIdentifiers",
}
KEEPALIVE_KEYS = {"SuccessfulExit", "NetworkState", "PathState", "OtherJobEnabled", "Crashed",
                  "AfterInitialDemand"}
RLIMIT_KEYS = {"Core", "CPU", "Data", "FileSize", "MemoryLock", "NumberOfFiles", "NumberOfProcesses",
               "ResidentSetSize", "Stack"}
LOG_DIR = "/usr/local/var/log/pd-bridge/"

def check_launchd():
    path = os.path.join(deploy, "launchd", "com.pd-bridge.decoded.plist")
    try:
        with open(path, "rb") as f:
            pl = plistlib.load(f, fmt=plistlib.FMT_XML)
    except Exception as e:  # missing file, bad XML, not a plist
        fail(f"{rel(path)}: not a valid XML property list: {e}")
        pl = None
    if pl is not None:
        problems = []
        def need(key, check, what):
            if key not in pl:
                problems.append(f"{key} missing")
            elif not check(pl[key]):
                problems.append(f"{key} should be {what}, is {pl[key]!r}")
        if not isinstance(pl, dict):
            problems.append("top level is not a dict")
            pl = {}
        unknown = sorted(set(pl) - LAUNCHD_KEYS)
        if unknown:
            problems.append(f"keys launchd does not know (ignored silently): {unknown}")
        need("Label", lambda v: v == "com.pd-bridge.decoded", "'com.pd-bridge.decoded'")
        need("ProgramArguments",
             lambda v: v == ["/usr/local/bin/decoded", "--config", "/usr/local/etc/pd-bridge/decoded.toml"],
             "['/usr/local/bin/decoded', '--config', '/usr/local/etc/pd-bridge/decoded.toml']")
        need("WorkingDirectory", lambda v: v == "/usr/local/var/pd-bridge", "'/usr/local/var/pd-bridge'")
        need("KeepAlive", lambda v: v == {"SuccessfulExit": False},
             "{SuccessfulExit: false} (restart on crash, not after a clean exit)")
        need("RunAtLoad", lambda v: v is True, "true")
        need("ProcessType", lambda v: v in ("Interactive", "Standard"), "'Interactive' or 'Standard'")
        for k in ("StandardOutPath", "StandardErrorPath"):
            need(k, lambda v: isinstance(v, str) and v.startswith(LOG_DIR) and len(v) > len(LOG_DIR),
                 f"a file under {LOG_DIR}")
        try:
            drain = example_value("decoded", "server", "drain_timeout")
            need("ExitTimeOut", lambda v: type(v) is int and v > drain,
                 f"an integer above server.drain_timeout ({drain:g}s)")
        except (ValueError, KeyError, OSError) as e:
            problems.append(f"drain_timeout: {e}")
        for k in ("Umask", "ThrottleInterval", "Nice", "TimeOut"):
            if k in pl and type(pl[k]) is not int:
                problems.append(f"{k} must be an integer")
        for k in ("UserName", "GroupName"):
            if k in pl and not isinstance(pl[k], str):
                problems.append(f"{k} must be a string")
        if isinstance(pl.get("KeepAlive"), dict) and set(pl["KeepAlive"]) - KEEPALIVE_KEYS:
            problems.append(f"KeepAlive: unknown keys {sorted(set(pl['KeepAlive']) - KEEPALIVE_KEYS)}")
        for k in ("SoftResourceLimits", "HardResourceLimits"):
            if k in pl:
                if not isinstance(pl[k], dict) or set(pl[k]) - RLIMIT_KEYS or \
                        any(type(v) is not int for v in pl[k].values()):
                    problems.append(f"{k}: only integer values of {sorted(RLIMIT_KEYS)}")
        env = pl.get("EnvironmentVariables")
        if not isinstance(env, dict):
            problems.append("EnvironmentVariables missing or not a dict")
        else:
            if any(not isinstance(v, str) for v in env.values()):
                problems.append("EnvironmentVariables: every value must be a string")
            if env.get("HF_HUB_OFFLINE") != "1":
                problems.append("EnvironmentVariables: HF_HUB_OFFLINE must be '1'")
            if not env.get("RUST_LOG"):
                problems.append("EnvironmentVariables: RUST_LOG missing")
            if "/usr/local/bin" not in str(env.get("PATH", "")).split(":"):
                problems.append("EnvironmentVariables: PATH must include /usr/local/bin")
            for key in ("CERT", "KEY", "CA"):
                if not env.get(f"PDB_TLS__{key}", "").startswith("/usr/local/etc/pd-bridge/certs/"):
                    problems.append(f"EnvironmentVariables: PDB_TLS__{key} must name a file in /usr/local/etc/pd-bridge/certs/")
        if shutil.which("plutil"):  # macOS
            r = subprocess.run(["plutil", "-lint", path], capture_output=True, text=True)
            if r.returncode != 0:
                problems.append(f"plutil -lint: {r.stdout.strip()} {r.stderr.strip()}")
        report(path, problems, f"property list with the required keys, types and values")

# --- Grafana dashboard ----------------------------------------------------------------------
def catalogue():
    """The daemons' metrics as common/src/metric.rs declares them: {name: (type, labels)}."""
    text = open(os.path.join(root, "common", "src", "metric.rs")).read()
    found = re.findall(r'Metric::(counter|gauge|histogram)\(\s*"([a-z0-9_]+)",\s*&\[([^\]]*)\]', text)
    return {name: (kind, set(re.findall(r'"([a-z0-9_]+)"', labels))) for kind, name, labels in found}

DECLARED = catalogue()
# A histogram's series: its buckets, count and sum.
METRICS = {n + suffix for n, (kind, _) in DECLARED.items()
           for suffix in (("_bucket", "_count", "_sum") if kind == "histogram" else ("",))}
# The labels of the declared metrics, a histogram's bucket bound, and those Prometheus's scrape adds.
LABELS = set().union(*(labels for _, labels in DECLARED.values())) | {"le", "role", "job", "instance"}
# What the dashboard must chart (a declared metric each).
CHARTED = {
    "pdbridge_bridge_outcomes_total", "pdbridge_stream_bytes_total", "pdbridge_push_bytes_total",
    "pdbridge_stream_blocks_total", "pdbridge_store_blocks_committed_total",
    "pdbridge_stream_payload_bytes_per_token", "pdbridge_store_bytes", "pdbridge_store_budget_bytes",
    "pdbridge_store_blocks", "pdbridge_store_lookups_total", "pdbridge_store_evictions_total",
    "pdbridge_store_quarantined_total", "pdbridge_engine_up", "pdbridge_engine_restarts_total",
    "pdbridge_front_requests_in_flight", "pdbridge_push_streams_in_flight", "pdbridge_prefill_in_flight",
    "grpc_server_handled_total", "pdbridge_prefill_requests_total", "pdbridge_build_info",
    "pdbridge_insecure_listeners", "pdbridge_front_unauthorized_total", "pdbridge_push_memory_bytes",
    "pdbridge_push_memory_limit_bytes", "pdbridge_engine_alive", "pdbridge_tls_cert_expiry_timestamp_seconds",
    "pdbridge_ttft_seconds_bucket", "pdbridge_stage_seconds_bucket", "pdbridge_prefill_duration_seconds_bucket",
    "grpc_server_handling_seconds_bucket", "http_server_request_duration_seconds_bucket",
    "http_server_request_duration_seconds_count",
}
DS_UID = "${DS_PROMETHEUS}"

def recorded():
    """rules.yml's recording rules: each recorded name with the metric names its expression reads."""
    text = open(os.path.join(deploy, "prometheus", "rules.yml")).read()
    blocks = re.split(r"^\s*-\s*(?=record:|alert:)", text, flags=re.M)[1:]
    return {m.group(1): set(re.findall(r"\b(?:pdbridge|grpc_server|http_server)_[a-z0-9_]+", b))
            for b in blocks if (m := re.match(r"record:\s*(\S+)", b))}

RECORDS = recorded()

def balanced(expr):
    stack, pairs, quote = [], {")": "(", "]": "[", "}": "{"}, None
    for ch in expr:
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'`":
            quote = ch
        elif ch in "([{":
            stack.append(ch)
        elif ch in ")]}":
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack and quote is None

def all_panels(panels):
    for p in panels:
        yield p
        yield from all_panels(p.get("panels", []))  # collapsed rows nest their panels

def check_grafana():
    path = os.path.join(deploy, "grafana", "pd-bridge.json")
    try:
        with open(path) as f:
            dash = json.load(f)
    except Exception as e:
        fail(f"{rel(path)}: not valid JSON: {e}")
        dash = None
    if dash is not None:
        problems, used = [], set()
        if dash.get("title") != "pd-bridge":
            problems.append(f"title should be 'pd-bridge', is {dash.get('title')!r}")
        if not isinstance(dash.get("uid"), str) or not dash.get("uid"):
            problems.append("uid missing")
        if not isinstance(dash.get("schemaVersion"), int) or dash["schemaVersion"] < 36:
            problems.append(f"schemaVersion should be an integer >= 36, is {dash.get('schemaVersion')!r}")
        inputs = [i for i in dash.get("__inputs", []) if i.get("name") == "DS_PROMETHEUS"]
        if not inputs or inputs[0].get("type") != "datasource" or inputs[0].get("pluginId") != "prometheus":
            problems.append("__inputs lacks DS_PROMETHEUS (type datasource, pluginId prometheus)")
        tvars = [v for v in dash.get("templating", {}).get("list", []) if v.get("name") == "DS_PROMETHEUS"]
        if not tvars or tvars[0].get("type") != "datasource" or tvars[0].get("query") != "prometheus":
            problems.append("templating lacks variable DS_PROMETHEUS (type datasource, query prometheus)")
        panels = list(all_panels(dash.get("panels", [])))
        if not panels:
            problems.append("no panels")
        ids = [p.get("id") for p in panels]
        if len(set(ids)) != len(ids) or None in ids:
            problems.append(f"panel ids must be present and unique: {ids}")
        for p in panels:
            name = f"panel {p.get('id')} {p.get('title')!r}"
            g = p.get("gridPos", {})
            if not all(isinstance(g.get(k), int) for k in "xywh") or g["x"] + g["w"] > 24:
                problems.append(f"{name}: gridPos needs integer x, y, w, h within 24 columns")
            if p.get("type") == "row":
                continue
            if not p.get("title"):
                problems.append(f"{name}: no title")
            targets = p.get("targets") or []
            exprs = [t.get("expr", "") for t in targets if isinstance(t.get("expr"), str) and t["expr"].strip()]
            if not exprs:
                problems.append(f"{name}: no target with an expr")
            refs = [t.get("refId") for t in targets]
            if len(set(refs)) != len(refs):
                problems.append(f"{name}: duplicate refId")
            for obj in [p] + targets:
                ds = obj.get("datasource")
                if ds is not None and (ds.get("uid") != DS_UID or ds.get("type") != "prometheus"):
                    problems.append(f"{name}: datasource should be prometheus / {DS_UID}, is {ds}")
            for expr in exprs:
                if not balanced(expr):
                    problems.append(f"{name}: unbalanced brackets or quotes in {expr!r}")
                names = set(re.findall(r"\b(?:pdbridge|grpc_server|http_server)_[a-z0-9_]+", expr))
                for record in re.findall(r"\bpdbridge:[a-z0-9_:]+", expr):
                    if record not in RECORDS:
                        problems.append(f"{name}: {record} is not recorded by prometheus/rules.yml")
                    names |= RECORDS.get(record, set())
                used |= names
                for m in sorted(names - METRICS):
                    problems.append(f"{name}: {m} is not one of the daemons' metrics")
                labels = set()
                for grp in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
                    labels |= {l.strip() for l in grp.split(",") if l.strip()}
                for sel in re.findall(r"\{([^}]*)\}", expr):
                    labels |= set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", sel))
                for l in sorted(labels - LABELS):
                    problems.append(f"{name}: label {l!r} is not one of {sorted(LABELS)}")
        for m in sorted(CHARTED - METRICS):
            problems.append(f"{m}, which the dashboard must chart, is not declared in common/src/metric.rs")
        missing = sorted(CHARTED - used)
        if missing:
            problems.append(f"metrics with no panel: {missing}")
        report(path, problems, f"{len(panels)} panels, each with an expr; only the daemons' metrics and labels")

# --- Prometheus scrape config ---------------------------------------------------------------
JOBS = {"pdbridge-prefilld": ("9471", "prefill"), "pdbridge-decoded": ("9470", "decode")}

def yaml_python():
    """A Python that has PyYAML, for prometheus.yml: this one, else the repo's engine venv; "" if
    neither (a structural check instead)."""
    for cand in (sys.executable, os.path.join(root, ".venv", "bin", "python")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK) and subprocess.run(
                [cand, "-c", "import yaml"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0:
            return cand
    return ""


def check_prometheus(yaml_py):
    path = os.path.join(deploy, "prometheus", "prometheus.yml")
    problems = []
    try:
        text = open(path).read()
    except OSError as e:
        fail(f"{rel(path)}: {e}")
        text = None
    if text is not None and yaml_py:
        how = "YAML (PyYAML)"
        prog = ("import json, sys, yaml\n"
                "try:\n    conf = yaml.safe_load(open(sys.argv[1]))\n"
                "except yaml.YAMLError as e:\n    sys.exit(' '.join(str(e).split()))\n"
                "print(json.dumps(conf))")
        r = subprocess.run([yaml_py, "-c", prog, path], capture_output=True, text=True)
        if r.returncode != 0:
            problems.append(f"not valid YAML: {r.stderr.strip() or r.returncode}")
        else:
            conf = json.loads(r.stdout)
            glob = (conf or {}).get("global", {}) or {}
            jobs = {j.get("job_name"): j for j in (conf or {}).get("scrape_configs", []) or []}
            for job, (port, role) in JOBS.items():
                j = jobs.get(job)
                if j is None:
                    problems.append(f"job {job} missing")
                    continue
                if j.get("metrics_path") != "/metrics":
                    problems.append(f"{job}: metrics_path should be /metrics")
                statics = j.get("static_configs") or []
                targets = [t for s in statics for t in s.get("targets", [])]
                if not targets or any(not str(t).endswith(":" + port) for t in targets):
                    problems.append(f"{job}: targets should be host:{port}, are {targets}")
                if any((s.get("labels") or {}).get("role") != role for s in statics):
                    problems.append(f"{job}: every static_config needs labels: {{role: {role}}}")
                try:
                    interval = seconds(str(j.get("scrape_interval", glob.get("scrape_interval", "1m"))))
                    timeout = seconds(str(j.get("scrape_timeout", glob.get("scrape_timeout", "10s"))))
                    if not 5 <= interval <= 60:
                        problems.append(f"{job}: scrape interval {interval:g}s outside 5s..60s")
                    if timeout > interval:
                        problems.append(f"{job}: scrape_timeout {timeout:g}s exceeds the interval")
                except ValueError as e:
                    problems.append(f"{job}: {e}")
    elif text is not None:
        # No YAML parser: a structural check of the same facts.
        how = "structure (no PyYAML here)"
        if "\t" in text:
            problems.append("tabs are not allowed in YAML indentation")
        if not re.search(r"^scrape_configs:\s*$", text, re.M):
            problems.append("no top-level scrape_configs:")
        blocks = re.split(r"^\s*-\s+job_name:\s*", text, flags=re.M)[1:]
        found = {b.split("\n", 1)[0].strip().strip("\"'"): b for b in blocks}
        for job, (port, role) in JOBS.items():
            b = found.get(job)
            if b is None:
                problems.append(f"job {job} missing")
                continue
            if not re.search(r"^\s*metrics_path:\s*[\"']?/metrics[\"']?\s*$", b, re.M):
                problems.append(f"{job}: metrics_path should be /metrics")
            if not re.search(rf":{port}[\"']", b):
                problems.append(f"{job}: no target on port {port}")
            if not re.search(rf"^\s*role:\s*[\"']?{role}[\"']?\s*$", b, re.M):
                problems.append(f"{job}: labels need role: {role}")
        if not re.search(r"^\s*scrape_interval:\s*\S+", text, re.M):
            problems.append("no scrape_interval")
    if text is not None:
        problems += promtool_problems(["check", "config", path])
        report(path, problems, f"{how}: both jobs, ports, /metrics, role labels, interval; promtool check config")


def promtool():
    """promtool: PROMTOOL=, else the one scripts/setup-prometheus.sh unpacked, else PATH's."""
    unpacked = os.path.join(root, "var", "prometheus", "usr", "bin", "promtool")
    return os.environ.get("PROMTOOL") or (unpacked if os.access(unpacked, os.X_OK) else shutil.which("promtool"))


def promtool_problems(args):
    tool = promtool()
    if not tool:
        return ["promtool not found: run scripts/setup-prometheus.sh (or set PROMTOOL=)"]
    r = subprocess.run([tool, *args], capture_output=True, text=True, cwd=os.path.join(deploy, "prometheus"))
    return [] if r.returncode == 0 else [f"promtool {' '.join(args[:2])}: {(r.stdout + r.stderr).strip()}"]


def check_rules():
    path = os.path.join(deploy, "prometheus", "rules.yml")
    problems = promtool_problems(["check", "rules", path])
    problems += promtool_problems(["test", "rules", os.path.join(deploy, "prometheus", "rules.test.yml")])
    alerts = re.findall(r"^\s*-\s*alert:\s*(\S+)", open(path).read(), re.M)
    if not alerts:
        problems.append("no alerts")
    tests = open(os.path.join(deploy, "prometheus", "rules.test.yml")).read()
    runbook = open(os.path.join(deploy, "README.md")).read()
    for alert in alerts:
        if f"alertname: {alert}" not in tests:
            problems.append(f"{alert}: no unit test in rules.test.yml")
        if f"`{alert}`" not in runbook:
            problems.append(f"{alert}: no runbook line in deploy/README.md")
    report(path, problems, f"promtool check rules, promtool test rules; {len(alerts)} alerts, each tested, each with a runbook line")


def main():
    with tempfile.TemporaryDirectory(prefix="pdb-deploy-check.") as tmp:
        systemd_analyze(tmp)
    check_units()
    check_examples()
    check_launchd()
    check_grafana()
    check_prometheus(yaml_python())
    check_rules()


if __name__ == "__main__":
    try:
        main()
    except Exception:  # a bug here, or a file it cannot cope with: a failure, not a pass
        traceback.print_exc()
        failures += 1
    if failures:
        print("deploy/check.sh: FAILED (see FAIL lines above)", file=sys.stderr)
        sys.exit(1)
    print("deploy/check.sh: all deployment files check out")
