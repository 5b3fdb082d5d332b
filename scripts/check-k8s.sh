#!/usr/bin/env bash
# Checks deploy/kubernetes/: every manifest against the official Kubernetes
# schemas (kubernetes-validate, strict: unknown fields are errors), and
# every container's arguments against this build of `arbor` (serve
# arguments through --print-config; router arguments must get past the
# command line and fail only on the unreachable in-cluster workers or the
# absent Kubernetes API).
#
#   PYTHON=venv/bin/python ARBOR=target/debug/arbor scripts/check-k8s.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
arbor=${ARBOR:-target/debug/arbor}
k8s=${K8S_VERSION:-1.30.0}
"$py" -m kubernetes_validate --strict --quiet -k "$k8s" deploy/kubernetes/*.yaml
echo "schemas: deploy/kubernetes/*.yaml valid for Kubernetes $k8s"
"$py" - "$arbor" deploy/kubernetes/*.yaml <<'PY'
import subprocess, sys, yaml
arbor, files = sys.argv[1], sys.argv[2:]
checked = 0
for f in files:
    for doc in yaml.safe_load_all(open(f)):
        spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            args = [str(a) for a in c.get("args", [])]
            if not args:
                continue
            name = f"{f}: {doc['metadata']['name']}/{c['name']}"
            if args[0] == "serve":
                # The model is not there: point at any file; --print-config checks the rest.
                a = list(args)
                if "--model-path" in a:
                    a[a.index("--model-path") + 1] = "/dev/null"
                r = subprocess.run([arbor] + a + ["--print-config"], capture_output=True, text=True)
                if r.returncode != 0:
                    sys.exit(f"{name}: arbor {' '.join(args)}\n{r.stderr}")
            elif args[0] == "router":
                a = list(args)
                if "--port" in a:
                    a[a.index("--port") + 1] = "0"
                r = subprocess.run([arbor] + a + ["--worker-startup-timeout-secs", "0"],
                                   capture_output=True, text=True, timeout=120)
                # Outside a cluster: unreachable workers, or no Kubernetes API for discovery.
                if r.returncode != 1 or not ("was not healthy" in r.stderr or "KUBERNETES_SERVICE_HOST" in r.stderr):
                    sys.exit(f"{name}: arbor {' '.join(args)} (exit {r.returncode})\n{r.stderr}")
            elif args[0] == "fetch-default":
                r = subprocess.run([arbor, "fetch-default", "--help"], capture_output=True, text=True)
                if r.returncode != 0:
                    sys.exit(f"{name}: {r.stderr}")
            else:
                sys.exit(f"{name}: unknown subcommand {args[0]}")
            checked += 1
print(f"arguments: {checked} containers accepted by {arbor}")
PY
