# The image the Helm chart runs: /webhook and /aggregator, statically linked,
# non-root. Build: docker build -t ghcr.io/tally-dev/tally:0.1.0 .
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags=-s -o /out/webhook ./cmd/webhook && \
    CGO_ENABLED=0 go build -trimpath -ldflags=-s -o /out/aggregator ./cmd/aggregator

FROM gcr.io/distroless/static:nonroot
COPY --from=build /out/webhook /out/aggregator /
USER 65532:65532
