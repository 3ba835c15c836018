# The Cloacina image: one image for the server (`serve`, the default command) and the
# DB-less agent (`runagent`, what the docker and kubernetes actuators start).
#
#   docker build -t cloacina:latest .
#   docker run --rm -p 8000:8000 -e DATABASE_URL=postgresql://… cloacina:latest
#   docker run --rm -e CLOACINA_AGENT_API_KEY=clk_… cloacina:latest runagent --server http://…:8000
#
# Without DATABASE_URL the server starts its embedded PostgreSQL under $CLOACINA_HOME
# (mount a volume at /data to keep it); production uses an external PostgreSQL.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first, so a source change does not reinstall them.  Every pin ships
# manylinux wheels (psycopg[binary], pgserver with its PostgreSQL, psutil, msgpack):
# no compiler or system library is needed on the slim base.
COPY requirements.txt ./
RUN pip install -r requirements.txt

# uid/gid 10001 is what the Kubernetes agent pods run as (runAsUser/runAsGroup/fsGroup).
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
