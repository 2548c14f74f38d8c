package podexpr

import (
	"reflect"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	apiservercel "k8s.io/apiserver/pkg/cel"
)

// podType returns the CEL type of a core/v1 Pod as it reads in JSON (and
// as celcommon.SchemalessTypedToVal presents it): fields by their JSON
// names, quantities as strings, times as strings or null (a time not set,
// such as a condition's lastProbeTime, is null, not absent). kind and
// apiVersion are left out: a pod from a watch has none.
func podType() *apiservercel.DeclType {
	return declType(reflect.TypeFor[corev1.Pod](), "tally.pod")
}

var (
	timeType     = reflect.TypeFor[metav1.Time]()
	microTime    = reflect.TypeFor[metav1.MicroTime]()
	quantityType = reflect.TypeFor[resource.Quantity]()
	intOrString  = reflect.TypeFor[intstr.IntOrString]()
	fieldsV1     = reflect.TypeFor[metav1.FieldsV1]()
	typeMeta     = reflect.TypeFor[metav1.TypeMeta]()
)

// declType returns the CEL type of Go type t, as JSON shows it; name names
// an object type (unique: its path from the pod).
func declType(t reflect.Type, name string) *apiservercel.DeclType {
	switch t {
	case quantityType:
		return apiservercel.StringType
	case timeType, microTime, intOrString, fieldsV1:
		return apiservercel.DynType
	}
	switch t.Kind() {
	case reflect.Pointer:
		return declType(t.Elem(), name)
	case reflect.Bool:
		return apiservercel.BoolType
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return apiservercel.IntType
	case reflect.Float32, reflect.Float64:
		return apiservercel.DoubleType
	case reflect.String:
		return apiservercel.StringType
	case reflect.Slice:
		if t.Elem().Kind() == reflect.Uint8 {
			return apiservercel.StringType // base64 in JSON
		}
		return apiservercel.NewListType(declType(t.Elem(), name+".items"), maxEntries)
	case reflect.Map:
		return apiservercel.NewMapType(apiservercel.StringType, declType(t.Elem(), name+".values"), maxEntries)
	case reflect.Struct:
		fields := map[string]*apiservercel.DeclField{}
		addFields(t, name, fields)
		return apiservercel.NewObjectType(name, fields)
	}
	return apiservercel.DynType
}

// addFields adds t's JSON fields to fields, those of inlined structs too.
func addFields(t reflect.Type, name string, fields map[string]*apiservercel.DeclField) {
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		tag, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		switch {
		case tag == "-":
			continue
		case tag == "" && f.Anonymous && f.Type == typeMeta:
			continue
		case tag == "" && f.Anonymous:
			addFields(f.Type, name, fields)
			continue
		case tag == "":
			tag = f.Name
		}
		field, ok := apiservercel.Escape(tag)
		if !ok {
			continue
		}
		fields[field] = apiservercel.NewDeclField(field, declType(f.Type, name+"."+tag), false, nil, nil)
	}
}
