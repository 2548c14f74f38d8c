"""A WorkerPool operator written with Kopf, the tally way.

The operator keeps spec.replicas worker pods running. It never counts: on
scale-down it marks surplus pods with the annotation
tally.dev/completion-intent (one merge patch per pod, no read-modify-write),
then deletes them, so that each worker gets SIGTERM and its grace period to
finish; and it reads status.completing, status.active, status.completed and
status.unexpected, which tally's aggregator writes from the pods themselves.
It stops replacing a pool's crashed pods once status.unexpectedTotal (every
pod that ever finished without being asked to, counted at most once by tally even
after the pod is deleted) reaches its restart budget.

Run it (see README.md next to this file: values.yaml maps every status field
it reads, rbac.yaml grants what it calls, requirements.txt names the
versions it was run with):

    kopf run --standalone --namespace kopf-demo examples/kopf/operator.py
"""

import collections
import logging
import secrets
import threading

import kopf
import kubernetes

GROUP, VERSION, PLURAL = "example.tally.dev", "v1", "workerpools"
INTENT = "tally.dev/completion-intent"
TERMINAL = ("Succeeded", "Failed")
# Pods asked to complete keep their node resources until they exit: at most
# this many replacements run beside them.
MAX_SURGE = 2
# A pool whose pods exited unexpectedly this many times in all gets no more
# replacements: its crashes need a person, not another pod.
RESTART_BUDGET = 5

# Built at start-up, once the configuration is loaded: a client built at
# import time would talk to http://localhost.
core: kubernetes.client.CoreV1Api

# Kopf runs a pool's timer and its change handlers concurrently: one lock per
# pool keeps two of them from creating the same missing pods.
pool_locks: dict = collections.defaultdict(threading.Lock)

# The pools whose exhausted restart budget was reported: the event is posted
# once when the budget runs out, not on every timer run.
budget_reported: set = set()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, logger: logging.Logger, **_):
    global core
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    core = kubernetes.client.CoreV1Api()
    # Kopf would keep its handler progress in status.kopf, which the
    # WorkerPool schema does not declare (the API server would prune it on
    # every change): keep it in annotations instead.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kopf.example.tally.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kopf.example.tally.dev")
    # Post what a person needs to see: the operator's own events (kopf.event
    # is posted at any level) and warnings, not one "Timer 'reconcile'
    # succeeded." every five seconds.
    settings.posting.level = logging.WARNING
    logger.info("Configured: counts come from tally, handler progress lives in annotations")


def owned_pods(namespace: str, uid: str) -> list:
    """The pool's pods: those whose controller ownerReference is the pool.

    The ownerReference, not the label, defines them: a pod admitted while
    tally's webhook was down carries no label until tally stamps it."""
    pods = core.list_namespaced_pod(namespace).items
    return [p for p in pods
            if any(ref.controller and ref.uid == uid for ref in (p.metadata.owner_references or []))]


def is_live(pod) -> bool:
    """Running or starting, not asked to complete, not going away."""
    return (INTENT not in (pod.metadata.annotations or {})
            and pod.status.phase not in TERMINAL
            and pod.metadata.deletion_timestamp is None)


def mark_for_completion(pod, reason: str = "scale-down") -> bool:
    """Mark one pod; False when it finished before the mark landed.

    One key, merge patch: nothing is read and written back, so nothing is
    lost when other handlers run at the same time. tally's webhook makes the
    intent sticky and stamps who set it and when. It refuses (403) an intent
    on a pod that has already finished (crashed, or being deleted): that
    pod's end counts as unexpected, and delete_exited removes it."""
    try:
        core.patch_namespaced_pod(pod.metadata.name, pod.metadata.namespace,
                                  {"metadata": {"annotations": {INTENT: reason}}})
    except kubernetes.client.exceptions.ApiException as e:
        if e.status in (403, 404):
            return False
        raise
    return True


def stop(pod) -> None:
    """End a marked pod: delete it, so that its worker gets SIGTERM and the
    pod's grace period to finish its work and exit (the pause container
    exits at once). tally counts it in status.completing until it is gone,
    and in status.completedTotal. The UID precondition keeps a new pod that
    took the name from being deleted instead."""
    options = kubernetes.client.V1DeleteOptions(preconditions=kubernetes.client.V1Preconditions(uid=pod.metadata.uid))
    try:
        core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, body=options)
    except kubernetes.client.exceptions.ApiException as e:
        if e.status not in (404, 409):
            raise


def new_pod(body, name: str) -> dict:
    meta = body["metadata"]
    # The pool's identity, exactly as tally's webhook would stamp it: the API
    # server then admits the pod without calling the webhook. The name label
    # only when the name is a valid label value (a pool's name is one when it
    # has at most 63 characters).
    labels = {"app.kubernetes.io/name": "worker", "app.kubernetes.io/instance": name,
              "tally.dev/parent-uid": meta["uid"]}
    if len(meta["name"]) <= 63:
        labels["tally.dev/parent-name"] = meta["name"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{meta['name']}-{secrets.token_hex(3)}",
            "namespace": meta["namespace"],
            "labels": labels,
            "annotations": {"tally.dev/parent": f"WorkerPool.{GROUP}/{meta['name']}"},
            "ownerReferences": [{
                "apiVersion": f"{GROUP}/{VERSION}", "kind": "WorkerPool",
                "name": meta["name"], "uid": meta["uid"],
                "controller": True, "blockOwnerDeletion": True,
            }],
        },
        "spec": {
            # A worker that exits is replaced by a new pod, not restarted:
            # its end is final, and counted.
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 30,
            "containers": [{"name": "worker", "image": "registry.k8s.io/pause:3.10"}],
        },
    }


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec.replicas")
@kopf.timer(GROUP, VERSION, PLURAL, interval=5, initial_delay=5)
def reconcile(body, spec, status, name, namespace, uid, logger, **_):
    """Level-triggered: compare the live pods with spec.replicas, from a
    fresh list, on every change and every few seconds."""
    # The counts are tally's: read them, never write them. unexpectedTotal
    # outlives the pods delete_exited removes; a counter kept here would
    # race with that handler and forget what happened before a restart.
    restarts = status.get("unexpectedTotal") or 0
    with pool_locks[uid]:
        scale(body, spec.get("replicas", 0), status.get("completing") or 0, name, namespace, uid,
              may_replace=restarts < RESTART_BUDGET)
    # status.ready is a count the configuration defines (customCounts): the
    # pods whose Ready condition is True, kept by tally as the others are,
    # where an operator would count readiness changes in a pod handler.
    logger.debug("tally counts: completing=%s active=%s completed=%s unexpected=%s unexpectedTotal=%s ready=%s",
                 status.get("completing"), status.get("active"), status.get("completed"), status.get("unexpected"),
                 restarts, status.get("ready"))


def scale(body, replicas: int, completing: int, name: str, namespace: str, uid: str,
          may_replace: bool = True) -> None:
    pods = owned_pods(namespace, uid)
    # A pod marked but not stopped yet (the operator stopped between the
    # two): stop it now.
    for pod in pods:
        if (INTENT in (pod.metadata.annotations or {}) and pod.status.phase not in TERMINAL
                and pod.metadata.deletion_timestamp is None):
            stop(pod)
    live = sorted((p for p in pods if is_live(p)), key=lambda p: p.metadata.name)
    if len(live) > replicas:
        marked = 0
        for pod in live[replicas:]:
            if mark_for_completion(pod):
                marked += 1
                stop(pod)
        kopf.event(body, type="Normal", reason="ScalingDown",
                   message=f"asked {marked} pods to complete and stopped them; tally shows them in status.completing until they are gone")
    elif len(live) < replicas:
        # Recreate what is missing: pods asked to complete are not live (the
        # pods' own intent says so), and tally's status.completing says how
        # many of them still run, within the surge they may share.
        missing = min(replicas - len(live), replicas + MAX_SURGE - len(live) - completing)
        if missing > 0 and not may_replace:
            if uid not in budget_reported:
                budget_reported.add(uid)
                kopf.warn(body, reason="RestartBudgetExhausted",
                          message=f"{RESTART_BUDGET} pods exited unexpectedly (status.unexpectedTotal): not replacing them")
            return
        for _ in range(missing):
            core.create_namespaced_pod(namespace, new_pod(body, name))
        if missing > 0:
            kopf.event(body, type="Normal", reason="ScalingUp", message=f"created {missing} pods ({completing} still completing)")


def exited_worker(body, **_) -> bool:
    """A pod of a WorkerPool that finished and is not being deleted yet."""
    return (body.get("status", {}).get("phase") in TERMINAL
            and not body["metadata"].get("deletionTimestamp")
            and any(ref.get("controller") and ref.get("kind") == "WorkerPool"
                    and ref.get("apiVersion", "").startswith(GROUP + "/")
                    for ref in body["metadata"].get("ownerReferences", [])))


@kopf.on.event("", "v1", "pods", when=exited_worker)
def delete_exited(name, namespace, logger, **_):
    """Remove pods that finished: completed ones leave status.completed,
    crashed ones leave status.unexpected, and the next reconcile replaces
    what is missing."""
    try:
        core.delete_namespaced_pod(name, namespace)
    except kubernetes.client.exceptions.ApiException as e:
        if e.status != 404:
            raise
    logger.info("Deleted exited pod %s", name)
