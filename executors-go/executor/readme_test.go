package executor_test

import (
	"bytes"
	"go/ast"
	"go/format"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// exampleMarker precedes each Go block of the README: the block shows the
// code of that function (and the declarations it uses) of that file.
var exampleMarker = regexp.MustCompile("(?m)^<!-- example: (\\S+) (\\w+) -->\n```go\n((?s:.*?))```\n")

// The README's examples are the compiled (and, for the executortest one, run)
// code of example_test.go files: every Go block of the README must carry a
// marker, and show that function's body as the body of its main (or of the
// function of the same name), the file's other declarations it shows
// verbatim, and exactly the imports its code uses.
func TestReadmeShowsTheExamples(t *testing.T) {
	readme, err := os.ReadFile(filepath.Join("..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	blocks := exampleMarker.FindAllSubmatch(readme, -1)
	if all := bytes.Count(readme, []byte("```go\n")); all != len(blocks) || all == 0 {
		t.Fatalf("the README has %d Go blocks, %d of them marked with <!-- example: FILE FUNC -->", all, len(blocks))
	}
	for _, m := range blocks {
		file, fn, code := string(m[1]), string(m[2]), m[3]
		t.Run(fn, func(t *testing.T) {
			src, err := os.ReadFile(filepath.Join("..", file))
			if err != nil {
				t.Fatal(err)
			}
			checkReadmeBlock(t, code, src, fn)
		})
	}
}

type parsed struct {
	file  *ast.File
	decls map[string]string // declaration name -> its source (bodies for funcs)
}

func parseGo(t *testing.T, what string, src []byte) parsed {
	t.Helper()
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, what, src, parser.ParseComments)
	if err != nil {
		t.Fatalf("%s does not parse: %v", what, err)
	}
	p := parsed{file: f, decls: map[string]string{}}
	text := func(from, to token.Pos) string {
		return string(src[fset.Position(from).Offset:fset.Position(to).Offset])
	}
	for _, d := range f.Decls {
		switch d := d.(type) {
		case *ast.FuncDecl:
			p.decls["func "+d.Name.Name] = text(d.Body.Lbrace+1, d.Body.Rbrace)
		case *ast.GenDecl:
			if d.Tok == token.IMPORT {
				continue
			}
			for _, s := range d.Specs {
				if ts, ok := s.(*ast.TypeSpec); ok {
					p.decls["type "+ts.Name.Name] = text(ts.Pos(), ts.End())
				}
			}
		}
	}
	return p
}

func checkReadmeBlock(t *testing.T, code, exampleSrc []byte, fn string) {
	if formatted, err := format.Source(code); err != nil || !bytes.Equal(formatted, code) {
		t.Errorf("the README block is not gofmt-formatted (%v)", err)
	}
	block := parseGo(t, "README block", code)
	example := parseGo(t, "example file", exampleSrc)
	want, ok := example.decls["func "+fn]
	if !ok {
		t.Fatalf("the example file has no func %s", fn)
	}
	shown := false
	for name, got := range block.decls {
		if name == "func main" || name == "func "+fn {
			shown = true
			if got != want {
				t.Errorf("the README's %s is not %s of the example file:\n--- README\n%s\n--- example\n%s", name, fn, got, want)
			}
			continue
		}
		if example.decls[name] != got {
			t.Errorf("the README's %s differs from the example file's:\n--- README\n%s\n--- example\n%s", name, got, example.decls[name])
		}
	}
	if !shown {
		t.Errorf("the README block has neither main nor %s", fn)
	}

	// Exactly the imports the code uses.
	imported := map[string]bool{}
	for _, im := range block.file.Imports {
		path, _ := strconv.Unquote(im.Path.Value)
		name := path[strings.LastIndexByte(path, '/')+1:]
		if im.Name != nil {
			name = im.Name.Name
		}
		imported[name] = true
	}
	used := map[string]bool{}
	ast.Inspect(block.file, func(n ast.Node) bool {
		if sel, ok := n.(*ast.SelectorExpr); ok {
			if id, ok := sel.X.(*ast.Ident); ok && id.Obj == nil {
				used[id.Name] = true
			}
		}
		return true
	})
	for name := range imported {
		if !used[name] {
			t.Errorf("the README block imports %s but does not use it", name)
		}
	}
	for name := range used {
		if !imported[name] {
			t.Errorf("the README block uses %s but does not import it", name)
		}
	}
}
