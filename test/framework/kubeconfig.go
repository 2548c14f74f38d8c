package framework

import "k8s.io/client-go/tools/clientcmd"

// KubeconfigAs writes to path a copy of the kubeconfig admin that
// impersonates the service account ns/sa, as a component of the chart runs.
func KubeconfigAs(admin []byte, ns, sa, path string) error {
	cfg, err := clientcmd.Load(admin)
	if err != nil {
		return err
	}
	for _, auth := range cfg.AuthInfos {
		auth.Impersonate = "system:serviceaccount:" + ns + ":" + sa
		auth.ImpersonateGroups = []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"}
	}
	return clientcmd.WriteToFile(*cfg, path)
}
