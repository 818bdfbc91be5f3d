#!/usr/bin/env bash
# Install the real coding clients that tests/clients/ drives, at pinned versions, into
# the git-ignored folder .clients/ at the repository root:
#   .clients/node/          Codex CLI, Claude Code, opencode (npm --prefix)
#   .clients/aider-venv/    aider (its own venv: aider pins many packages)
# A stamp file per client records what is installed, so a second run with the same pins
# does nothing. Override a pin with the environment variable named beside it.
# Exit status: 0 installed (or already there), 3 a registry was unreachable, other: failed.
set -euo pipefail

CODEX_VERSION="${CODEX_VERSION:-0.171.0}"              # @openai/codex
CLAUDE_CODE_VERSION="${CLAUDE_CODE_VERSION:-2.1.332}"  # @anthropic-ai/claude-code
OPENCODE_VERSION="${OPENCODE_VERSION:-1.18.33}"        # opencode-ai
AIDER_VERSION="${AIDER_VERSION:-0.86.2}"               # aider-chat (PyPI)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="${LODESTAR_CLIENTS_DIR:-$ROOT/.clients}"
PYTHON="${AIDER_PYTHON:-python3}"
ONLY="${*:-codex claude opencode aider}"   # install_clients.sh [codex] [claude] [opencode] [aider]

mkdir -p "$DEST/node" "$DEST/stamps"
# No telemetry, update checks or funding prompts while installing.
export npm_config_fund=false npm_config_audit=false npm_config_update_notifier=false
export DISABLE_AUTOUPDATER=1 PIP_DISABLE_PIP_VERSION_CHECK=1

declare -A REACHED=()
reachable() {  # $1: npm|pypi; asked once per run, without retries, so an offline run ends fast
  if [[ -z "${REACHED[$1]:-}" ]]; then
    case "$1" in
      npm) timeout 30 npm view --silent --fetch-retries=0 is-number version >/dev/null 2>&1 ;;
      pypi) timeout 60 "$PYTHON" -m pip download --no-deps --quiet --retries 0 --timeout 15 \
              -d "$DEST/.probe" "aider-chat==$AIDER_VERSION" >/dev/null 2>&1 ;;
    esac && REACHED[$1]=yes || REACHED[$1]=no
  fi
  [[ "${REACHED[$1]}" == yes ]]
}

npm_client() {  # $1: short name, $2: package, $3: version
  local stamp="$DEST/stamps/$1" want="$2@$3"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then echo "$1: $want already installed"; return; fi
  reachable npm || { echo "$1: the npm registry is unreachable" >&2; return 3; }
  local t0=$SECONDS
  # saved in .clients/node/package.json, so that the next client's install keeps this one
  npm install --prefix "$DEST/node" --save-exact --loglevel=error "$want" || return 1
  echo "$want" > "$stamp"
  echo "$1: installed $want in $((SECONDS - t0)) s"
}

aider_client() {
  local stamp="$DEST/stamps/aider" want="aider-chat==$AIDER_VERSION"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then echo "aider: $want already installed"; return; fi
  reachable pypi || { echo "aider: PyPI is unreachable" >&2; return 3; }
  local t0=$SECONDS
  rm -rf "$DEST/aider-venv" "$DEST/.probe"
  "$PYTHON" -m venv "$DEST/aider-venv" || return 1
  "$DEST/aider-venv/bin/python" -m pip install --quiet "$want" || return 1
  echo "$want" > "$stamp"
  echo "aider: installed $want in $((SECONDS - t0)) s"
}

status=0  # each client is tried even when one before it failed; 3 wins over 1
for c in $ONLY; do
  rc=0
  case "$c" in
    codex) npm_client codex @openai/codex "$CODEX_VERSION" || rc=$? ;;
    claude) npm_client claude @anthropic-ai/claude-code "$CLAUDE_CODE_VERSION" || rc=$? ;;
    opencode) npm_client opencode opencode-ai "$OPENCODE_VERSION" || rc=$? ;;
    aider) aider_client || rc=$? ;;
    *) echo "unknown client $c (codex, claude, opencode, aider)" >&2; exit 2 ;;
  esac
  if (( rc == 3 )); then status=3; elif (( rc != 0 && status == 0 )); then status=1; fi
done
exit $status
