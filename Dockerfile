# The Cloacina image: one image for the server (`serve`, the default command) and the
# DB-less agent (`runagent`, what the docker and kubernetes actuators start).
#
#   docker build -t cloacina:latest .
#   docker run --rm -p 8000:8000 -e DATABASE_URL=postgresql://… cloacina:latest
#   docker run --rm -e CLOACINA_AGENT_API_KEY=clk_… cloacina:latest runagent --server http://…:8000
#
# Build arguments and secrets (BuildKit, the default builder of Docker 23+; Debian's docker.io
# 20.10 needs DOCKER_BUILDKIT=1):
#   --build-arg BASE_IMAGE=…   any image with Python 3.11+ and its venv module (default
#                              python:3.11-slim); scripts/build-agent-image makes a Debian one
#                              locally with debootstrap, for machines without an image registry.
#   --secret id=pip_ca,src=/etc/ssl/certs/ca-certificates.crt
#                              a CA bundle pip trusts instead of its own (a TLS-inspecting
#                              proxy's CA); mounted for the one `pip install` step only, so
#                              nothing of it is left in any layer of the image.
#
# Without DATABASE_URL the server starts its embedded PostgreSQL under $CLOACINA_HOME
# (mount a volume at /data to keep it); production uses an external PostgreSQL.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# The dependencies live in a virtualenv: a Debian base's system Python is externally managed
# (PEP 668), and the same path on every base keeps `python` the venv's interpreter.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

WORKDIR /app

# Dependencies first, so a source change does not reinstall them.  Every pin ships
# manylinux wheels (psycopg[binary], pgserver with its PostgreSQL, psutil, msgpack):
# no compiler or system library is needed on the slim base.
COPY requirements.txt ./
# pip's download cache is a BuildKit cache mount: a changed pin re-downloads only that wheel,
# and neither the cache nor the CA secret is part of any layer.
RUN --mount=type=secret,id=pip_ca \
    --mount=type=cache,target=/root/.cache/pip \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
    && python3 -m venv /opt/venv \
    && env -u PIP_NO_CACHE_DIR /opt/venv/bin/pip install -r requirements.txt

# uid/gid 10001 is what the Kubernetes agent pods and the docker actuator's containers run as.
RUN groupadd --system --gid 10001 cloacina \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/cloacina --create-home \
       --shell /usr/sbin/nologin cloacina \
    && mkdir -p /data \
    && chown 10001:10001 /data

COPY --chown=root:root . .

# The source stays root-owned and read-only to the service user; only $CLOACINA_HOME
# and $HOME are written (the agent pods mount emptyDir volumes there).
ENV CLOACINA_HOME=/data \
    HOME=/home/cloacina \
    DJANGO_SETTINGS_MODULE=cloacina_site.settings

USER 10001:10001
EXPOSE 8000

ENTRYPOINT ["python", "manage.py"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
