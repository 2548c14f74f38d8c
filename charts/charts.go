// Package charts holds the files of tally's Helm chart that Go code reads
// too, so that the chart and the binaries share one source.
package charts

import "embed"

// MatchConditions holds the CEL expressions of the webhook registration's
// match conditions, one file per condition named after it, with the
// placeholders that pkg/mutate and the chart's templates fill in.
//
//go:embed tally/files/match-conditions/*.cel
var MatchConditions embed.FS
