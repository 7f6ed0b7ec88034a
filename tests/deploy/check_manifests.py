#!/usr/bin/env python3
"""CTest deploy_manifests: deploy/kubernetes/*.yaml parse, and the fields gradsync relies on
agree across them and with the runtime (docs/packaging.md, "Kubernetes"); deploy/slurm/*.sbatch
pass `bash -n`. Usage: check_manifests.py REPO_ROOT"""
import os
import subprocess
import sys

import yaml

root = sys.argv[1]
errors = []


def check(cond, message):
    if not cond:
        errors.append(message)
    return cond


def flag(args, name):
    for a in args:
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def mounts(pod, container):
    """mountPath -> volume of the container's volumeMounts."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return {m["mountPath"]: volumes.get(m["name"], {}) for m in container.get("volumeMounts", [])}


def mounted_from_secret(path, by_path):
    return any(path.startswith(p + "/") and "secret" in v for p, v in by_path.items())


docs = {}
kdir = os.path.join(root, "deploy", "kubernetes")
for name in sorted(os.listdir(kdir)):
    if name.endswith(".yaml"):
        with open(os.path.join(kdir, name)) as f:
            for d in yaml.safe_load_all(f):
                if d:
                    check("apiVersion" in d and "kind" in d and "name" in d.get("metadata", {}), f"{name}: a document without apiVersion/kind/metadata.name")
                    docs[(d["kind"], d["metadata"]["name"])] = d
with open(os.path.join(root, "runtime", "common", "launch_env.cc")) as f:
    launch_env = f.read()

# The coordinator: one replica, --listen port = containerPort = the Service's target, mTLS from a secret.
dep = docs.get(("Deployment", "gradsync-coordinator"))
svc = docs.get(("Service", "gradsync-coordinator"))
coord_addr = None
if check(dep and svc, "coordinator Deployment and Service missing"):
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    check(dep["spec"]["replicas"] == 1, "coordinator: jobs live in one process's memory, replicas must be 1")
    check(c["command"] == ["/usr/bin/gradsync-coordinator"], "coordinator: command")
    listen = flag(c["args"], "--listen")
    port = int(listen.rsplit(":", 1)[1]) if check(listen, "coordinator: no --listen") else None
    check(any(p["containerPort"] == port for p in c.get("ports", [])), "coordinator: --listen port is not a containerPort")
    by_path = mounts(pod, c)
    for tls in ("--tls-cert", "--tls-key", "--tls-ca"):
        v = flag(c["args"], tls)
        check(v and mounted_from_secret(v, by_path), f"coordinator: {tls} is not a file of a mounted secret")
    check("--require-client-cert" in c["args"], "coordinator: --require-client-cert (mTLS) missing")
    check(svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"], "coordinator: Service selector does not match the pods")
    sp = svc["spec"]["ports"][0]
    coord_addr = f'{svc["metadata"]["name"]}.{svc["metadata"]["namespace"]}.svc:{sp["port"]}'
    check(sp["targetPort"] in [p.get("name") for p in c["ports"]] + [port], "coordinator: Service targetPort")

# The daemon: its socket in a hostPath directory, memory-backed /dev/shm, IPC_LOCK, the coordinator's address.
ds = docs.get(("DaemonSet", "gradsyncd"))
socket = daemon_gid = None
if check(ds, "gradsyncd DaemonSet missing"):
    pod = ds["spec"]["template"]["spec"]
    c = pod["containers"][0]
    check(c["command"] == ["/usr/bin/gradsyncd"], "gradsyncd: command")
    socket = flag(c["args"], "--socket")
    by_path = mounts(pod, c)
    if check(socket, "gradsyncd: no --socket"):
        vol = by_path.get(os.path.dirname(socket), {})
        check(vol.get("hostPath", {}).get("type") in ("DirectoryOrCreate", "Directory"), "gradsyncd: the socket's directory is not a hostPath directory")
    check(by_path.get("/dev/shm", {}).get("emptyDir", {}).get("medium") == "Memory", "gradsyncd: /dev/shm is not memory-backed")
    check("IPC_LOCK" in c.get("securityContext", {}).get("capabilities", {}).get("add", []), "gradsyncd: no IPC_LOCK (memlock)")
    check(flag(c["args"], "--coordinator") == coord_addr, f"gradsyncd: --coordinator is not the Service ({coord_addr})")
    for tls in ("--tls-cert", "--tls-key", "--tls-ca"):
        v = flag(c["args"], tls)
        check(v and mounted_from_secret(v, by_path), f"gradsyncd: {tls} is not a file of a mounted secret")
    check(pod.get("hostNetwork") is True, "gradsyncd: hostNetwork (the data path uses the node's addresses)")
    daemon_gid = pod.get("securityContext", {}).get("runAsGroup")
    check(daemon_gid is not None, "gradsyncd: runAsGroup (the socket's group) missing")

# The JobSet: reaches the daemon's socket, may use it, and hands gradsyncrun its node index.
js = docs.get(("JobSet", "train"))
if check(js, "example JobSet missing"):
    for rj in js["spec"]["replicatedJobs"]:
        pod = rj["template"]["spec"]["template"]["spec"]
        for c in pod["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            check(env.get("GRADSYNC_DAEMON", {}).get("value") == socket, "jobset: GRADSYNC_DAEMON is not the DaemonSet's socket")
            by_path = mounts(pod, c)
            check("hostPath" in by_path.get(os.path.dirname(socket or "/x"), {}), "jobset: the daemon's socket directory is not mounted")
            check(daemon_gid in pod.get("securityContext", {}).get("supplementalGroups", []), "jobset: pods lack the socket's group")
            check("value" not in env.get("GRADSYNC_JOB_TOKEN", {"value": 1}), "jobset: the job token must come from a secret")
            for var, annotation in (("JOBSET_JOB_GLOBAL_INDEX", "job-global-index"), ("JOBSET_GLOBAL_REPLICAS", "global-replicas")):
                path = env.get(var, {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
                check(f"jobset.sigs.k8s.io/{annotation}" in path, f"jobset: {var} does not come from the {annotation} annotation")
                check(f'"{var}"' in launch_env, f"jobset: runtime/common/launch_env.cc does not read {var}")
            check(c["command"][0] == "/usr/bin/gradsyncrun", "jobset: the pod's command is not gradsyncrun")

for name in sorted(os.listdir(os.path.join(root, "deploy", "slurm"))):
    r = subprocess.run(["bash", "-n", os.path.join(root, "deploy", "slurm", name)], capture_output=True, text=True)
    check(r.returncode == 0, f"deploy/slurm/{name}: {r.stderr.strip()}")

for e in errors:
    print("deploy check: " + e)
print(f"deploy check: {len(docs)} Kubernetes documents, {len(errors)} problem(s)")
sys.exit(1 if errors else 0)
