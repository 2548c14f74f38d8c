// Command conventional-webhook is the pod-stamping webhook an operator author
// would write with controller-runtime, the baseline of the bench's webhook
// scenario: controller-runtime's webhook server and a CustomDefaulter that
// decodes the pod, stamps the same keys as tally's webhook, and answers
// through PatchResponseFromRaw.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/webhook"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	"tally.dev/tally/pkg/keys"
)

func main() {
	certDir := flag.String("cert-dir", "", "directory holding tls.crt and tls.key")
	port := flag.Int("port", 9443, "port")
	flag.Parse()
	server := webhook.NewServer(webhook.Options{Host: "127.0.0.1", Port: *port, CertDir: *certDir})
	server.Register("/mutate-pods", admission.WithCustomDefaulter(clientgoscheme.Scheme, &corev1.Pod{}, stamper{}))
	if err := server.Start(ctrl.SetupSignalHandler()); err != nil {
		fmt.Fprintln(os.Stderr, "conventional-webhook:", err)
		os.Exit(1)
	}
}

// stamper stamps a WorkerPool's pods with their parent's identity, and the
// time and requester of a new completion intent.
type stamper struct{}

func (stamper) Default(ctx context.Context, obj runtime.Object) error {
	pod := obj.(*corev1.Pod)
	ref := metav1.GetControllerOf(pod)
	if ref == nil || ref.Kind != "WorkerPool" {
		return nil
	}
	if pod.Labels == nil {
		pod.Labels = map[string]string{}
	}
	if pod.Annotations == nil {
		pod.Annotations = map[string]string{}
	}
	pod.Labels[keys.ParentUID] = string(ref.UID)
	pod.Labels[keys.ParentName] = ref.Name
	pod.Annotations[keys.Parent] = "WorkerPool.example.tally.dev/" + ref.Name
	if _, ok := pod.Annotations[keys.CompletionIntent]; ok && pod.Annotations[keys.CompletionIntentAt] == "" {
		req, err := admission.RequestFromContext(ctx)
		if err != nil {
			return err
		}
		pod.Annotations[keys.CompletionIntentAt] = time.Now().UTC().Format(time.RFC3339)
		pod.Annotations[keys.CompletionIntentBy] = req.UserInfo.Username
	}
	return nil
}
