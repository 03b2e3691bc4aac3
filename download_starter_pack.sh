#!/usr/bin/env bash
# Download llm.c's starter pack: GPT-2 124M weights (fp32 and bf16), its debug state, the tokenizer,
# the tiny shakespeare shards and hellaswag's val set, from karpathy's public HuggingFace dataset.
#
#   ./download_starter_pack.sh                       # all files (~1.3 GB)
#   ./download_starter_pack.sh gpt2_tokenizer.bin    # only the files named
#   LLMC_STARTER_PACK_URL=http://mirror/dir ./download_starter_pack.sh   # another server
#
# Files land where llm.c keeps them: the models and the tokenizer in the repo root, the data under
# dev/data/. Safe to re-run and to interrupt:
#  - a file whose size equals the server's Content-Length (HEAD request) is complete: skipped;
#  - a download goes to <name>.part, resumes from there (curl -C -), and is renamed to <name> only
#    once its size (and sha256, when the server gives one in x-linked-etag, as HuggingFace does)
#    checks out, so a partial file never sits under the final name;
#  - when the server can't be reached, existing files are kept; a missing one is an error.
# Any failure prints one line on stderr and exits non-zero.
set -euo pipefail

BASE_URL="${LLMC_STARTER_PACK_URL:-https://huggingface.co/datasets/karpathy/llmc-starter-pack/resolve/main}"
BASE_URL="${BASE_URL%/}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# name on the server, path here (relative to the repo root)
FILES=(
  gpt2_124M.bin               gpt2_124M.bin
  gpt2_124M_bf16.bin          gpt2_124M_bf16.bin
  gpt2_124M_debug_state.bin   gpt2_124M_debug_state.bin
  gpt2_tokenizer.bin          gpt2_tokenizer.bin
  tiny_shakespeare_train.bin  dev/data/tinyshakespeare/tiny_shakespeare_train.bin
  tiny_shakespeare_val.bin    dev/data/tinyshakespeare/tiny_shakespeare_val.bin
  hellaswag_val.bin           dev/data/hellaswag/hellaswag_val.bin
)

CURL=(curl --location --connect-timeout 10 --retry 2 --retry-delay 1)
if [ -t 2 ]; then PROGRESS=(--progress-bar); else PROGRESS=(--silent); fi
OFFLINE=""   # set to curl's reason once the server has been found unreachable

die() { echo "download_starter_pack.sh: $*" >&2; exit 1; }

file_size() { wc -c < "$1" | tr -d ' '; }

reason() {  # curl exit code -> words
  case "$1" in
    5|6) echo "could not resolve the host" ;;
    7) echo "could not connect" ;;
    28) echo "timed out" ;;
    22) echo "HTTP error" ;;
    35|51|58|60) echo "TLS error" ;;
    52|55|56) echo "connection broken" ;;
    *) echo "curl exit code $1" ;;
  esac
}

sha256_of() {
  if command -v sha256sum >/dev/null; then sha256sum "$1" | cut -d' ' -f1
  elif command -v shasum >/dev/null; then shasum -a 256 "$1" | cut -d' ' -f1
  fi
}

# HEAD request, following redirects. Sets STATUS (last response), LENGTH (its Content-Length, or
# empty) and SHA (a 64-hex x-linked-etag of any response, or empty). Returns curl's exit code.
head_info() {
  local out rc=0
  out=$("${CURL[@]}" --silent --head "$1" 2>/dev/null) || rc=$?
  [ "$rc" -eq 0 ] || return "$rc"
  out=$(printf '%s\n' "$out" | tr -d '\r')
  STATUS=$(printf '%s\n' "$out" | awk '/^HTTP\//{s=$2} END{print s}')
  LENGTH=$(printf '%s\n' "$out" | awk '/^HTTP\//{l=""} tolower($1)=="content-length:"{l=$2} END{print l}')
  SHA=$(printf '%s\n' "$out" | awk 'tolower($1)=="x-linked-etag:"{gsub(/"/,"",$2); print $2}' \
        | grep -E '^[0-9a-f]{64}$' | tail -n 1 || true)
}

fetch() {  # fetch NAME_ON_SERVER LOCAL_PATH
  local name="$1" rel="$2" url="$BASE_URL/$1" dest="$ROOT/$2" part="$ROOT/$2.part" rc=0 size
  if [ -z "$OFFLINE" ]; then
    head_info "$url" || rc=$?
    [ "$rc" -eq 0 ] || OFFLINE="$(reason "$rc")"
  fi
  if [ -n "$OFFLINE" ]; then
    [ -f "$dest" ] || die "cannot reach $BASE_URL ($OFFLINE) to fetch $name; check the network or set LLMC_STARTER_PACK_URL"
    echo "$rel: server unreachable ($OFFLINE), keeping the existing file"
    return 0
  fi
  [ "$STATUS" = 200 ] || die "$url: HTTP ${STATUS:-?} (expected 200: is $name on the server?)"

  if [ -f "$dest" ]; then
    size=$(file_size "$dest")
    if [ -z "$LENGTH" ] || [ "$size" = "$LENGTH" ]; then
      echo "$rel: complete ($size bytes), skipping"
      return 0
    fi
    echo "$rel: $size bytes here, $LENGTH on the server: fetching it again"
  fi
  mkdir -p "$(dirname "$dest")"
  if [ -f "$part" ] && [ -n "$LENGTH" ] && [ "$(file_size "$part")" -gt "$LENGTH" ]; then
    rm -f "$part"  # longer than the file on the server: not a prefix of it
  fi
  if [ -f "$part" ] && [ -n "$LENGTH" ] && [ "$(file_size "$part")" = "$LENGTH" ]; then
    :  # a previous run got every byte but stopped before the rename
  else
    if [ -s "$part" ]; then echo "$rel: resuming at $(file_size "$part") of ${LENGTH:-?} bytes"
    else echo "$rel: downloading ${LENGTH:-?} bytes"; fi
    "${CURL[@]}" "${PROGRESS[@]}" --fail -C - -o "$part" "$url" 2>/dev/null || rc=$?
    if [ "$rc" -eq 33 ]; then  # the server refuses byte ranges: start this file over
      rm -f "$part"; rc=0
      "${CURL[@]}" "${PROGRESS[@]}" --fail -o "$part" "$url" 2>/dev/null || rc=$?
    fi
    [ "$rc" -eq 0 ] || die "$url: download failed ($(reason "$rc")); run again to resume from $rel.part"
  fi

  size=$(file_size "$part")
  if [ -n "$LENGTH" ] && [ "$size" != "$LENGTH" ]; then
    die "$rel.part: $size bytes, the server said $LENGTH; run again to resume"
  fi
  if [ -n "$SHA" ]; then
    local got; got=$(sha256_of "$part")
    if [ -n "$got" ] && [ "$got" != "$SHA" ]; then
      rm -f "$part"
      die "$rel: sha256 $got, the server said $SHA; removed the download, run again"
    fi
  fi
  mv -f "$part" "$dest"
  echo "$rel: done ($size bytes)"
}

# -----------------------------------------------------------------------------
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 0
fi
command -v curl >/dev/null || die "curl not found (install curl)"

NAMES=""
for ((i = 0; i < ${#FILES[@]}; i += 2)); do NAMES="$NAMES ${FILES[i]}"; done
for want in "$@"; do  # check every name before downloading anything
  case " $NAMES " in *" $want "*) ;; *) die "unknown file $want (the pack has:$NAMES)" ;; esac
done
for ((i = 0; i < ${#FILES[@]}; i += 2)); do
  name="${FILES[i]}"
  if [ $# -gt 0 ]; then
    case " $* " in *" $name "*) ;; *) continue ;; esac
  fi
  fetch "$name" "${FILES[i + 1]}"
done
if [ -n "$OFFLINE" ]; then echo "offline: kept the existing files; run again with a network to check them"; fi
