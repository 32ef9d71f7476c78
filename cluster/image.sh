#!/usr/bin/env bash
# The cluster image in one step: build cluster/Dockerfile, push it, and name it in the cluster configs
# (cluster/aws.yaml's docker.image and every image: of cluster/kuberay/*.yaml), so `ray up` and
# `kubectl apply` run what was pushed. `make image IMAGE=...` calls it.
#   bash cluster/image.sh REGISTRY/prolip-ray:TAG [--no-push]
# The configs are renamed only after the push succeeded ($DOCKER: the docker client, `docker` by default).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE="${1:?usage: bash cluster/image.sh REGISTRY/prolip-ray:TAG [--no-push]}"
DOCKER="${DOCKER:-docker}"
case "$IMAGE" in
  *[[:space:]#\|]* | -*) echo "cluster/image.sh: not an image name: $IMAGE" >&2; exit 2 ;;
esac
"$DOCKER" build -f cluster/Dockerfile -t "$IMAGE" .
if [ "${2:-}" != "--no-push" ]; then
  "$DOCKER" push "$IMAGE"
fi
for f in cluster/aws.yaml cluster/kuberay/*.yaml; do
  sed -i -E "s|^([[:space:]]*image: )[^[:space:]]+|\1$IMAGE|" "$f"
done
echo "image $IMAGE built$( [ "${2:-}" != "--no-push" ] && echo ', pushed') and named in cluster/aws.yaml and cluster/kuberay/"
