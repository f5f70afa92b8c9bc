# Sourced by the GPU scripts: PY = $PYTHON if set, else the GPU image's torch venv, else the project's
# .venv, else python3.
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x /opt/torch/.venv/bin/python3 ]; then PY=/opt/torch/.venv/bin/python3
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
