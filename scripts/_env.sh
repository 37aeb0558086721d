# shellcheck shell=bash
# Sourced helper (scripts that source it run under `set -euo pipefail`).
#
#   source scripts/_env.sh
#   ensure_venv DIR PYVER REQFILE
#
# Creates the venv DIR with the pyenv interpreter for PYVER (e.g. 3.12) if it
# is missing, then installs (with uv, pinned below and installed into the venv by
# pip; pip itself if uv cannot be installed) REQFILE, the packages of REQFILE's "-nodeps" twin
# (requirements/py312.txt -> requirements/py312-nodeps.txt) if there is one,
# with --no-deps (packages whose own dependency tree the tests do not need, e.g.
# verl), and the project itself (editable, no deps) -- but only when the stamp
# stored inside the venv does not match the current inputs (hash of REQFILE,
# of its twin and of pyproject.toml). A re-run with nothing changed does no pip
# work at all.

_VS_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_VS_STAMP_NAME=".megatron-vocabstats.stamp"

_vs_err() { echo "ensure_venv: error: $*" >&2; }

# Print the path of a Python interpreter for version PYVER (3.12 or 3.12.1).
_vs_find_python() {
    local ver="$1" prefix="" root="" cand=""
    if command -v pyenv >/dev/null 2>&1; then
        prefix="$(pyenv prefix "$ver" 2>/dev/null | head -n1)" || prefix=""
        root="$(pyenv root 2>/dev/null)" || root=""
    fi
    if [[ -n "$prefix" && -x "$prefix/bin/python" ]]; then
        echo "$prefix/bin/python"
        return 0
    fi
    # Fallback: glob the pyenv versions dir, newest patch release first.
    root="${root:-${PYENV_ROOT:-$HOME/.pyenv}}"
    cand="$(
        shopt -s nullglob
        for d in "$root/versions/$ver" "$root/versions/$ver".*; do
            [[ -x "$d/bin/python" ]] && basename "$d"
        done | grep -E '^[0-9]+(\.[0-9]+)*$' | sort -V | tail -n1
    )" || cand=""
    if [[ -n "$cand" ]]; then
        echo "$root/versions/$cand/bin/python"
        return 0
    fi
    return 1
}

# pip with quiet output; drops the machine-local 'Location ... is ignored'
# warnings (from extra-index-url config), keeps everything else, and keeps
# pip's exit status (pipefail).
#
# The requirement files pin exact versions; an ambient pip constraints file (pip config
# `global.constraint`, or PIP_CONSTRAINT) must not change a pin behind our back (this machine's
# config caps torch at 2.14.1, below the primary venv's pin), so pip runs here without one.
_vs_pip() {
    local py="$1"
    shift
    PIP_CONSTRAINT=/dev/null "$py" -m pip "$@" 2>&1 | { grep -v -E "^WARNING: Location '.*' is ignored: it is neither a file nor a directory\.$" || true; }
}

# The installer of the venvs' packages: uv (a wheel from PyPI; it downloads in parallel and
# installs from its cache, ~/.cache/uv: a torch venv in ~15 s cold, where pip took 110-190 s),
# into the venv. uv reads neither pip's configuration nor its constraints files; UV_CONSTRAINT
# and UV_OVERRIDE are cleared for the same reason as PIP_CONSTRAINT above. --compile-bytecode
# writes the .pyc files at install, as pip does: with PYTHONDONTWRITEBYTECODE set (as on this
# machine) nothing writes them later, and every process would compile torch's sources again
# (importing torch and megatron.core took 42 s instead of 14 on a loaded machine).
_VS_UV="uv==0.13.9"
_vs_install() {  # _vs_install VENV_PYTHON [uv pip install args...]
    local py="$1" uv
    shift
    uv="$(dirname "$py")/uv"
    if [[ ! -x "$uv" ]]; then
        _vs_pip "$py" install -q "$_VS_UV" || true
    fi
    if [[ -x "$uv" ]]; then
        env -u UV_CONSTRAINT -u UV_OVERRIDE "$uv" pip install -q --compile-bytecode --python "$py" "$@"
    else
        echo "ensure_venv: $_VS_UV could not be installed; installing with pip" >&2
        _vs_pip "$py" install -q "$@"
    fi
}

ensure_venv() {
    if [[ $# -ne 3 ]]; then
        _vs_err "usage: ensure_venv DIR PYVER REQFILE"
        return 2
    fi
    local dir="$1" pyver="$2" req="$3"
    local py="$dir/bin/python" stamp="$dir/$_VS_STAMP_NAME" want have="" base t0
    local nodeps="${req%.txt}-nodeps.txt"

    if [[ ! -f "$req" ]]; then
        _vs_err "requirement file '$req' not found"
        return 1
    fi

    # Rebuild a venv that is broken or was made with another Python minor.
    if [[ -e "$dir" ]]; then
        if [[ ! -f "$dir/pyvenv.cfg" || ! -x "$py" ]]; then
            if [[ -f "$dir/pyvenv.cfg" ]]; then
                echo "ensure_venv: $dir is broken; recreating" >&2
                rm -rf -- "$dir"
            else
                _vs_err "'$dir' exists but is not a venv; remove it by hand"
                return 1
            fi
        elif ! grep -qE "^version(_info)?[[:space:]]*=[[:space:]]*${pyver//./\\.}(\.|$)" "$dir/pyvenv.cfg"; then
            echo "ensure_venv: $dir was not made with Python $pyver; recreating" >&2
            rm -rf -- "$dir"
        fi
    fi

    if [[ ! -d "$dir" ]]; then
        if ! base="$(_vs_find_python "$pyver")"; then
            _vs_err "no Python $pyver found (looked in 'pyenv prefix $pyver' and" \
                "${PYENV_ROOT:-\$(pyenv root)}/versions/$pyver*); install it with: pyenv install $pyver"
            return 1
        fi
        echo "ensure_venv: creating $dir with $base" >&2
        "$base" -m venv "$dir"
    fi

    want="req=$(sha256sum <"$req" | cut -d' ' -f1) pyproject=$(sha256sum <"$_VS_ROOT/pyproject.toml" | cut -d' ' -f1)"
    [[ -f "$nodeps" ]] && want+=" nodeps=$(sha256sum <"$nodeps" | cut -d' ' -f1)"
    [[ -f "$stamp" ]] && have="$(<"$stamp")"
    if [[ "$have" == "$want" ]]; then
        return 0
    fi

    echo "ensure_venv: installing $req into $dir" >&2
    local ambient=""
    ambient="$("$py" -m pip config get global.constraint 2>/dev/null || true)"
    [[ -n "${PIP_CONSTRAINT:-}" ]] && ambient="${ambient:+$ambient }$PIP_CONSTRAINT"
    if [[ -n "$ambient" ]]; then
        echo "ensure_venv: not applying the ambient pip constraints ($ambient): $req pins exact versions" >&2
    fi
    t0=$SECONDS
    rm -f -- "$stamp"
    _vs_install "$py" -r "$req"
    if [[ -f "$nodeps" ]]; then
        _vs_install "$py" --no-deps -r "$nodeps"
    fi
    _vs_install "$py" --no-deps -e "$_VS_ROOT"
    echo "$want" >"$stamp"
    echo "ensure_venv: $dir ready ($((SECONDS - t0)) s)" >&2
}
