module github.com/durable-runtime/durable/executors-go

go 1.24

require google.golang.org/protobuf v1.36.11
