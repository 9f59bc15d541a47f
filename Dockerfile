# CPU image of the geonear server. Build: docker build -t geonear .
# Run:   docker run -p 50051:50051 -v geonear-data:/data geonear
# The build steps live in docker/install.sh, which tests/test_packaging.py also runs in
# a fresh virtual environment, so the image's recipe is exercised without a Docker engine.
FROM python:3.12-slim

WORKDIR /src
COPY . /src
RUN bash docker/install.sh /usr/local/bin/python && rm -rf /src

# Bind all interfaces inside the container; publish the port to expose it.
ENV GEONEAR_HOST=0.0.0.0 \
    GEONEAR_PORT=50051 \
    GEONEAR_DATA_DIR=/data \
    GEONEAR_BACKEND=cpu
VOLUME /data
EXPOSE 50051
WORKDIR /data
CMD ["geonear", "serve", "--demo"]
